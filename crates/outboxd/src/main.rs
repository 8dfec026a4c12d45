fn main() -> std::process::ExitCode {
    outboxd::cmd::main()
}
