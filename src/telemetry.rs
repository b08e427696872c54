//! Metrics through the `metrics` facade (feature `metrics`); without the feature every
//! function here is empty. Names and meanings are listed in the README ("Metrics") and in
//! the crate docs; keep the three in step.

use std::time::Duration;

/// `redlease_acquire_total{outcome}`, and on success `redlease_acquire_wait_seconds`.
pub(crate) fn acquire(outcome: &'static str, waited: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("redlease_acquire_total", "outcome" => outcome).increment(1);
        if outcome == "acquired" {
            metrics::histogram!("redlease_acquire_wait_seconds").record(waited.as_secs_f64());
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, waited);
}

/// `redlease_contention_total`: an attempt found the lock held.
pub(crate) fn contended() {
    #[cfg(feature = "metrics")]
    metrics::counter!("redlease_contention_total").increment(1);
}

/// `redlease_hold_seconds`: a hold ended (released, dropped, forgotten or lost).
pub(crate) fn held(d: Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("redlease_hold_seconds").record(d.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = d;
}

/// `redlease_lost_total`: a held lease was found lost.
pub(crate) fn lost() {
    #[cfg(feature = "metrics")]
    metrics::counter!("redlease_lost_total").increment(1);
}

/// `redlease_release_total{outcome}`.
pub(crate) fn release(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("redlease_release_total", "outcome" => outcome).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// `redlease_watchdog_rounds_total` and `redlease_watchdog_round_seconds`: one batched
/// extension round trip.
pub(crate) fn watchdog_round(took: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("redlease_watchdog_rounds_total").increment(1);
        metrics::histogram!("redlease_watchdog_round_seconds").record(took.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = took;
}
