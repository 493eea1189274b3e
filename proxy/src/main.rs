//! `warmpath`: see [`warmpath::cli`].

fn main() -> std::process::ExitCode {
    warmpath::cli::main()
}
