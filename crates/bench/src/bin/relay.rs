//! The outboxd binary, built alongside the bench (with the bench's release profile) so the bench
//! always has a relay process to measure: exactly `outboxd::cmd::main`.

fn main() -> std::process::ExitCode {
    outboxd::cmd::main()
}
