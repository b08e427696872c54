//! Runs every check and prints, per check, states, unique states, depth, time and the
//! counterexamples found. `--deep`: the deeper bounds. `--trace`: print each trace.
use redlease_model::{check, checks};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let deep = args.iter().any(|a| a == "--deep");
    let traces = args.iter().any(|a| a == "--trace");
    let only = args.iter().skip(1).find(|a| !a.starts_with("--"));
    for c in checks(deep) {
        if only.is_some_and(|o| !c.name.contains(o.as_str())) {
            continue;
        }
        // A mutant stops at its counterexamples; the others explore all their bounds.
        let stop = c.name.starts_with("mutant").then_some(c.fails);
        let o = check(c.setup.clone(), 2, stop);
        let found: Vec<&str> = o.found.iter().map(|(p, _)| *p).collect();
        let ok = if stop.is_some() {
            c.fails.iter().all(|f| found.contains(f))
        } else {
            let mut w = c.fails.to_vec();
            w.sort_unstable();
            found == w
        };
        println!(
            "{} | {} states | {} unique | depth {} | {:.1?} | found {:?}{}",
            c.name,
            o.states,
            o.unique,
            o.depth,
            o.took,
            found,
            if ok { "" } else { " | UNEXPECTED" }
        );
        if traces {
            for (p, t) in &o.found {
                println!("  {p}: {t:?}");
            }
        }
    }
}
