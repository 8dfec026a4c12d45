//! What a packaged command line carries besides the binary, generated from the clap definitions
//! so they never drift from `--help`: `outboxd completions SHELL` (clap_complete) and
//! `outboxd man [--dir DIR]` (clap_mangen: `outboxd.1`, and `outboxd-<command>.1` per command).
//! The Debian package ships both (`scripts/package-deb.sh`).

use anyhow::Context;
use clap::CommandFactory;
use std::path::{Path, PathBuf};

/// `outboxd man`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ManArgs {
    /// Write `outboxd.1` and one `outboxd-<command>.1` per command into this directory
    /// instead of printing `outboxd.1`.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The command line as `--help` shows it, with the long version.
fn command() -> clap::Command {
    super::Cli::command().version(env!("CARGO_PKG_VERSION"))
}

/// Prints the completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) {
    clap_complete::generate(shell, &mut command(), "outboxd", &mut std::io::stdout());
}

/// Prints `outboxd.1`, or writes every page into `args.dir`; returns the files written.
pub fn man(args: &ManArgs) -> anyhow::Result<Vec<PathBuf>> {
    let cmd = command();
    match &args.dir {
        None => {
            clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?;
            Ok(vec![])
        }
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
            let mut written = Vec::new();
            write_pages(&cmd, "outboxd", dir, &mut written)?;
            Ok(written)
        }
    }
}

/// `name.1` for `cmd`, then `name-<sub>.1` for each subcommand, recursively.
fn write_pages(
    cmd: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> anyhow::Result<()> {
    let cmd = cmd.clone().display_name(name.to_string());
    let path = dir.join(format!("{name}.1"));
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    std::fs::write(&path, page).with_context(|| format!("write {}", path.display()))?;
    written.push(path);
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        write_pages(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// `--help` speaks to users: no requirement ids like "(R34)" from the project's notes.
    #[test]
    fn help_text_names_no_requirement_ids() {
        fn walk(cmd: &clap::Command, found: &mut Vec<String>) {
            let texts = [cmd.get_about(), cmd.get_long_about()]
                .into_iter()
                .flatten()
                .map(|t| t.to_string())
                .chain(cmd.get_arguments().flat_map(|a| {
                    [a.get_help(), a.get_long_help()]
                        .into_iter()
                        .flatten()
                        .map(|t| t.to_string())
                }));
            for t in texts {
                let id = t.split(|c: char| !c.is_ascii_alphanumeric()).any(|w| {
                    w.len() > 1 && w.starts_with('R') && w[1..].chars().all(|c| c.is_ascii_digit())
                });
                if id {
                    found.push(format!("{}: {t}", cmd.get_name()));
                }
            }
            for s in cmd.get_subcommands() {
                walk(s, found);
            }
        }
        let mut found = Vec::new();
        walk(&super::command(), &mut found);
        assert!(found.is_empty(), "{found:#?}");
    }

    #[test]
    fn every_command_gets_a_man_page() {
        let dir = std::env::temp_dir().join(format!("outboxd-man-{}", std::process::id()));
        let written = super::man(&super::ManArgs {
            dir: Some(dir.clone()),
        })
        .unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for n in [
            "outboxd.1",
            "outboxd-run.1",
            "outboxd-parked-retry.1",
            "outboxd-tail.1",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
        }
        let page = std::fs::read_to_string(dir.join("outboxd-run.1")).unwrap();
        assert!(page.contains(".TH outboxd-run"), "{page}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
