//! `cargo run --release -p redlease-nemesis -- --help`: see NEMESIS.md.

fn main() {
    println!("redlease-nemesis: see NEMESIS.md");
}
