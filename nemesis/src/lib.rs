//! The nemesis harness of redlease: a workload of every lock kind against real servers, faults
//! injected while it runs, and a checker over the holders' own records. See NEMESIS.md.

pub mod faults;
