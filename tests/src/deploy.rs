//! What the deployment tests share: the repository's deployment files read as their tools read
//! them (YAML documents, `kubectl kustomize` output), the tools themselves (installed by
//! scripts/deps.sh: a missing one fails the test, it never skips), and a container's command,
//! environment and mounted files turned into a process on this machine.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A tool on PATH or in `.dev/bin`; a missing one names the script that installs it.
pub fn tool(name: &str) -> PathBuf {
    let dev = repo().join(".dev/bin").join(name);
    if dev.is_file() {
        return dev;
    }
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    });
    found.unwrap_or_else(|| panic!("{name} is not installed: run scripts/deps.sh"))
}

/// Runs `cmd`, failing with its output unless it exits 0; returns stdout.
pub fn run_ok(cmd: &mut Command) -> Result<String> {
    let out: Output = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Every document of a YAML stream, merge keys (`<<: *anchor`) applied, as JSON values.
pub fn yaml_docs(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize;
    let mut docs = Vec::new();
    for d in serde_yaml::Deserializer::from_str(text) {
        let mut v = serde_yaml::Value::deserialize(d)?;
        v.apply_merge()?;
        if !v.is_null() {
            docs.push(serde_json::to_value(v)?);
        }
    }
    Ok(docs)
}

/// `kubectl kustomize DIR` (a directory under deploy/kubernetes): its text and its objects.
pub fn kustomize(dir: &str) -> Result<(String, Vec<Value>)> {
    let path = repo().join("deploy/kubernetes").join(dir);
    let text = run_ok(Command::new(tool("kubectl")).arg("kustomize").arg(&path))?;
    let docs = yaml_docs(&text)?;
    Ok((text, docs))
}

/// The objects of `kind` among `docs`.
pub fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// A string field (empty when absent).
pub fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// What a container runs: its arguments after the `outboxd` entrypoint, its environment
/// (values resolved), and the files it sees at container paths, as host paths.
#[derive(Debug, Default, Clone)]
pub struct Launch {
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// container path → host path (a file, or a directory of files)
    pub mounts: Vec<(String, PathBuf)>,
}

impl Launch {
    /// The host path of a container path, through the mounts (longest mount first).
    pub fn host_path(&self, container: &str) -> Option<PathBuf> {
        let mut ms: Vec<&(String, PathBuf)> = self.mounts.iter().collect();
        ms.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        ms.into_iter().find_map(|(c, h)| {
            if container == c {
                Some(h.clone())
            } else {
                container
                    .strip_prefix(&format!("{}/", c.trim_end_matches('/')))
                    .map(|rest| h.join(rest))
            }
        })
    }

    /// The environment as the process on this machine gets it: values that are container
    /// paths become host paths.
    pub fn host_env(&self) -> BTreeMap<String, String> {
        self.env
            .iter()
            .map(|(k, v)| {
                let v = match self.host_path(v) {
                    Some(p) if v.starts_with('/') => p.display().to_string(),
                    _ => v.clone(),
                };
                (k.clone(), v)
            })
            .collect()
    }

    /// The relay binary with exactly this environment (plus `HOSTNAME`) and arguments.
    pub fn command(&self, hostname: &str) -> Command {
        let mut cmd = Command::new(crate::relay_bin());
        cmd.args(&self.args)
            .env_clear()
            .envs(self.host_env())
            .env("HOSTNAME", hostname)
            .stdin(Stdio::null());
        outboxd_testkit::die_with_parent(&mut cmd);
        cmd
    }
}

impl Launch {
    /// Runs it to the end: whether it exited 0, and its stdout and stderr together.
    pub fn output(&self, hostname: &str) -> Result<(bool, String)> {
        let out = self.command(hostname).output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        Ok((out.status.success(), text))
    }
}

/// The config file a launch reads (`--config` or `OUTBOXD_CONFIG`), as a host path.
pub fn config_of(l: &Launch) -> Result<PathBuf> {
    let arg = l
        .args
        .iter()
        .position(|a| a == "--config" || a == "-c")
        .and_then(|i| l.args.get(i + 1));
    let path = arg
        .or(l.env.get("OUTBOXD_CONFIG"))
        .context("neither --config nor OUTBOXD_CONFIG")?;
    l.host_path(path)
        .with_context(|| format!("{path} is not mounted"))
}

/// For each `OUTBOXD_<SECTION>_<KEY>` variable of `env`: it is an override outboxd applies (not
/// ignored), and it reaches its setting — the loaded config changes when its value does (a
/// `*_FILE` variable: the file's contents become one of the config's secrets). Returns the
/// variables checked.
pub fn every_override_reaches_its_setting(
    toml: &str,
    env: &BTreeMap<String, String>,
    scratch: &Path,
) -> Result<Vec<String>> {
    let load = |env: &BTreeMap<String, String>| {
        outboxd::Config::from_toml_and_env(toml, env.clone()).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let base = load(env)?;
    anyhow::ensure!(
        base.ignored_env.is_empty(),
        "outboxd ignores {:?}",
        base.ignored_env
    );
    let mut checked = Vec::new();
    for (k, v) in env {
        if !k.starts_with("OUTBOXD_") || k == "OUTBOXD_CONFIG" {
            continue;
        }
        let mut other = env.clone();
        if k.ends_with("_FILE") {
            let secret = format!("sentinel-secret-{}", k.len());
            let f = scratch.join(format!("sentinel-{k}"));
            std::fs::write(&f, &secret)?;
            other.insert(k.clone(), f.display().to_string());
            let cfg = load(&other)?;
            anyhow::ensure!(
                cfg.redactor.scrub(&secret) != secret,
                "{k}: the file's contents did not become a secret of the config"
            );
        } else {
            let sentinel = if v.contains("://") {
                v.replacen("://", "://sentinel", 1)
            } else if v.contains(':') {
                format!("sentinel.invalid:{}", v.rsplit(':').next().unwrap_or("1"))
            } else {
                format!("{v}_sentinel")
            };
            other.insert(k.clone(), sentinel);
            let cfg = load(&other)?;
            anyhow::ensure!(
                format!("{cfg:?}") != format!("{base:?}"),
                "{k}={v} changes no setting"
            );
        }
        checked.push(k.clone());
    }
    Ok(checked)
}

/// The ConfigMap named `name` among `docs`.
fn config_map<'a>(docs: &'a [Value], name: &str) -> Result<&'a Value> {
    of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == name)
        .with_context(|| format!("no ConfigMap {name}"))
}

/// The text of `key` in the ConfigMap that the pod's volume `volume` mounts.
pub fn config_map_file(docs: &[Value], pod: &Value, volume: &str, key: &str) -> Result<String> {
    let vol = pod["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == volume))
        .with_context(|| format!("no volume {volume}"))?;
    let cm = config_map(docs, s(&vol["configMap"]["name"]))?;
    Ok(s(&cm["data"][key]).to_string())
}

/// The first container of a rendered pod spec as a [`Launch`]: its `args` (after the image's
/// `outboxd` entrypoint), its environment with `configMapKeyRef`s resolved from `docs`, and its
/// mounts — ConfigMaps written into `scratch`, each Secret an empty directory
/// `scratch/secret-<name>` for the test to fill.
pub fn launch_of(docs: &[Value], pod: &Value, scratch: &Path) -> Result<Launch> {
    let c = &pod["containers"][0];
    anyhow::ensure!(c["command"].is_null(), "the image's entrypoint is outboxd");
    let mut l = Launch {
        args: c["args"]
            .as_array()
            .map(|a| a.iter().map(|x| s(x).to_string()).collect())
            .unwrap_or_default(),
        ..Launch::default()
    };
    for e in c["env"].as_array().into_iter().flatten() {
        let value = if let Some(r) = e["valueFrom"]["configMapKeyRef"].as_object() {
            let cm = config_map(docs, s(&r["name"]))?;
            s(&cm["data"][s(&r["key"])]).to_string()
        } else {
            anyhow::ensure!(e["valueFrom"].is_null(), "unexpected env source: {e}");
            s(&e["value"]).to_string()
        };
        l.env.insert(s(&e["name"]).to_string(), value);
    }
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let vol = pod["volumes"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["name"] == m["name"]))
            .with_context(|| format!("no volume for {m}"))?;
        let dir = if vol["configMap"].is_object() {
            let cm = config_map(docs, s(&vol["configMap"]["name"]))?;
            let dir = scratch.join(format!("cm-{}", s(&vol["name"])));
            std::fs::create_dir_all(&dir)?;
            for (k, v) in cm["data"].as_object().into_iter().flatten() {
                std::fs::write(dir.join(k), s(v))?;
            }
            dir
        } else {
            let dir = scratch.join(format!("secret-{}", s(&vol["secret"]["secretName"])));
            std::fs::create_dir_all(&dir)?;
            dir
        };
        let host = match m["subPath"].as_str() {
            Some(sub) => dir.join(sub),
            None => dir,
        };
        l.mounts.push((s(&m["mountPath"]).to_string(), host));
    }
    Ok(l)
}
