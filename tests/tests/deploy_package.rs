//! The Debian package and the systemd unit it installs: built by scripts/package-deb.sh
//! (cargo-deb), unpacked into a scratch root with dpkg, its binary run, its unit verified and
//! scored by `systemd-analyze`.
//!
//! The package is built from the debug binary the tests already have (`--profile dev
//! --no-build`): a release build would add ~8 minutes to CI, and the package's layout, unit and
//! maintainer data do not depend on the profile. Release packages: `scripts/package-deb.sh`.

use anyhow::Result;
use outboxd_tests::deploy::{every_override_reaches_its_setting, repo, run_ok, tool};
use outboxd_tests::relay_bin;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// `Key=Value` lines of a unit file, in order.
fn unit_entries(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn debian_package_installs_a_verified_hardened_unit_and_a_working_binary() -> Result<()> {
    let scratch = outboxd_testkit::tempdir("deb-")?;
    let target = scratch.path().join("target");
    std::fs::create_dir_all(target.join("debug"))?;
    std::fs::copy(relay_bin(), target.join("debug/outboxd"))?;
    let out = scratch.path().join("out");
    run_ok(
        Command::new("bash")
            .arg(repo().join("scripts/package-deb.sh"))
            .args(["--profile", "dev", "--no-build", "--fast", "-o"])
            .arg(&out)
            .env("CARGO_TARGET_DIR", &target),
    )?;
    let deb = std::fs::read_dir(&out)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .expect("a .deb");
    let root = scratch.path().join("root");
    run_ok(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    let depends = run_ok(Command::new("dpkg-deb").arg("-f").arg(&deb).arg("Depends"))?;
    assert!(depends.contains("libc6"), "{depends}");
    let control = scratch.path().join("control");
    run_ok(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control))?;
    let conffiles = std::fs::read_to_string(control.join("conffiles"))?;
    assert!(
        conffiles.contains("/etc/outboxd/outboxd.toml"),
        "{conffiles}"
    );

    // The installed binary runs.
    let bin = root.join("usr/bin/outboxd");
    let version = run_ok(Command::new(&bin).arg("--version"))?;
    assert!(
        version.contains(env!("CARGO_PKG_VERSION")) && version.contains("librdkafka"),
        "{version}"
    );
    for f in [
        "usr/lib/systemd/system/outboxd.service",
        "etc/outboxd/outboxd.toml",
        "usr/share/outboxd/sql/001_outbox.sql",
        "usr/share/outboxd/sql/roles.sql",
        "usr/share/outboxd/sql/optional/outbox_partitioned.sql",
        "usr/share/man/man1/outboxd.1.gz",
        "usr/share/man/man1/outboxd-run.1.gz",
        "usr/share/zsh/vendor-completions/_outboxd",
        "usr/share/fish/vendor_completions.d/outboxd.fish",
        "usr/share/doc/outboxd/copyright",
        "usr/share/doc/outboxd/deploy.md",
    ] {
        assert!(root.join(f).is_file(), "{f} is not in the package");
    }
    let bash_completion = root.join("usr/share/bash-completion/completions/outboxd");
    run_ok(Command::new("bash").arg("-n").arg(&bash_completion))?;
    let copyright = std::fs::read_to_string(root.join("usr/share/doc/outboxd/copyright"))?;
    assert!(copyright.contains("Apache License"), "{copyright:.200}");

    // The unit: verified where it points at the installed binary and man pages.
    let unit_path = root.join("usr/lib/systemd/system/outboxd.service");
    let unit = std::fs::read_to_string(&unit_path)?;
    let local = scratch.path().join("outboxd.service");
    std::fs::write(
        &local,
        unit.replace("/usr/bin/outboxd", &bin.display().to_string()),
    )?;
    run_ok(
        Command::new(tool("systemd-analyze"))
            .arg("verify")
            .arg(&local)
            .env("MANPATH", root.join("usr/share/man")),
    )?;
    let security = run_ok(
        Command::new(tool("systemd-analyze"))
            .args(["security", "--offline=yes", "--no-pager"])
            .arg(&unit_path),
    )?;
    let exposure: f64 = security
        .lines()
        .find_map(|l| l.split("outboxd.service: ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{security}"));
    assert!(
        exposure <= 2.0,
        "exposure {exposure} (systemd: ≤ 2 is OK):\n{security}"
    );

    let entries = unit_entries(&unit);
    let has = |k: &str, v: &str| entries.iter().any(|(a, b)| a == k && b == v);
    for (k, v) in [
        ("DynamicUser", "yes"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("Restart", "on-failure"),
        ("CapabilityBoundingSet", ""),
    ] {
        assert!(has(k, v), "{k}={v}");
    }
    // Stopping waits longer than the packaged config's drain.
    let config_text = std::fs::read_to_string(root.join("etc/outboxd/outboxd.toml"))?;
    let cfg = outboxd::Config::from_toml_and_env(&config_text, Vec::<(String, String)>::new())?;
    let stop: u64 = entries
        .iter()
        .find(|(k, _)| k == "TimeoutStopSec")
        .map(|(_, v)| v.trim_end_matches('s').parse().unwrap())
        .expect("TimeoutStopSec");
    assert!(
        stop * 1000 >= cfg.relay.shutdown_timeout_ms + 10_000,
        "{stop} s"
    );
    // Each credential reaches outboxd as a `*_FILE` key through %d (the credentials directory),
    // and every variable the unit sets reaches its setting.
    let creds = scratch.path().join("credentials");
    std::fs::create_dir_all(&creds)?;
    let mut env = BTreeMap::new();
    for (_, v) in entries.iter().filter(|(k, _)| k == "Environment") {
        let (name, value) = v.split_once('=').unwrap();
        env.insert(
            name.to_string(),
            value.replace("%d", &creds.display().to_string()),
        );
    }
    for (_, v) in entries.iter().filter(|(k, _)| k == "LoadCredential") {
        let name = v.split(':').next().unwrap();
        std::fs::write(creds.join(name), "secret")?;
        let var = env
            .iter()
            .find(|(k, val)| k.ends_with("_FILE") && Path::new(val).ends_with(name))
            .unwrap_or_else(|| panic!("credential {name} reaches no *_FILE key"));
        assert!(var.0.starts_with("OUTBOXD_"), "{var:?}");
    }
    let checked = every_override_reaches_its_setting(&config_text, &env, scratch.path())?;
    assert!(
        checked.contains(&"OUTBOXD_SOURCE_PASSWORD_FILE".to_string()),
        "{checked:?}"
    );
    Ok(())
}
