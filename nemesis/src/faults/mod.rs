//! The faults the nemesis injects that need more than a signal: a server's wall clock shifted
//! (an `LD_PRELOAD` shim on the server process only) and network partitions (network
//! namespaces and veth pairs).
