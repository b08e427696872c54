//! The nemesis harness of redlease: a workload of every lock kind against real servers, faults
//! injected while it runs, and a checker over the holders' own records. See NEMESIS.md.
//!
//! - [`record`]: what a holder writes down per critical section, and the file format;
//! - [`checker`]: the safety properties, checked over the records;
//! - [`workload`]: a worker process's seeded workload of every lock kind;
//! - [`topology`]: the servers of each configuration;
//! - [`schedule`]: the faults, a seeded schedule of them, and how each is injected and healed;
//! - [`run`]: one run of one configuration, from servers to the checker's report;
//! - [`faults`]: the faults that need more than a signal (clock shifts, partitions, a proxy).

#![forbid(unsafe_code)]

pub mod checker;
pub mod faults;
pub mod record;
pub mod run;
pub mod schedule;
mod support;
pub mod topology;
pub mod workload;
