//! The real `outboxd` binary, built as part of the test package so integration tests can
//! spawn (and SIGKILL) it without relying on another package's build artefacts.
fn main() -> std::process::ExitCode {
    outboxd::cmd::main()
}
