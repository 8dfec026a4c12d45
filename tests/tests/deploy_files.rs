//! The deployment files, checked by the tools of their ecosystems (installed by scripts/deps.sh;
//! a missing tool fails, never skips): the Dockerfile by hadolint and by the rules we chose, the
//! Kubernetes manifests rendered by `kubectl kustomize` and validated offline by
//! kubernetes-validate, the alert rules by promtool, the systemd unit by `systemd-analyze`, the
//! Debian package by dpkg. Running what these files configure: tests/tests/deploy_run.rs.

use anyhow::Result;
use outboxd_tests::deploy::{
    every_override_reaches_its_setting, kustomize, of_kind, repo, run_ok, s, tool, yaml_docs,
};
use outboxd_tests::relay_bin;
use serde_json::Value;
use std::process::Command;

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// hadolint finds nothing, and the image follows our rules: pinned bases, a numeric non-root
/// user, `outboxd` as entrypoint, a probe as HEALTHCHECK, OCI labels, no secret in the image,
/// every library the binary loads present at run time, and a build context without target/.
#[test]
fn dockerfile_passes_hadolint_and_our_rules() -> Result<()> {
    let out = Command::new(tool("hadolint"))
        .arg(repo().join("Dockerfile"))
        .output()?;
    assert!(
        out.status.success(),
        "hadolint:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let df = read("Dockerfile");
    // Continuation lines joined: one instruction per line.
    let joined = df.replace("\\\n", " ");
    let instructions: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let args: std::collections::BTreeMap<&str, &str> = instructions
        .iter()
        .filter_map(|l| l.strip_prefix("ARG "))
        .filter_map(|a| a.split_once('='))
        .collect();
    let froms: Vec<&str> = instructions
        .iter()
        .filter_map(|l| l.strip_prefix("FROM "))
        .collect();
    assert_eq!(froms.len(), 2, "multi-stage: a build and a runtime stage");
    for f in &froms {
        let image = f.split_whitespace().next().unwrap();
        let image = match image.strip_prefix("${").and_then(|x| x.strip_suffix('}')) {
            Some(arg) => args[arg],
            None => image,
        };
        let (name, tag) = image.rsplit_once(':').unwrap_or((image, ""));
        // distroless has no version tags: its name pins the Debian release (cc-debian12).
        let versioned = tag.chars().any(|c| c.is_ascii_digit())
            || (name.contains("distroless/") && name.contains("-debian1"));
        assert!(
            image.contains('@') || (versioned && !tag.contains("latest")),
            "{image}: pin the base (a versioned tag or a digest)"
        );
    }
    assert!(
        args[&"RUNTIME_IMAGE"].contains("distroless"),
        "no shell at run time"
    );
    let last_stage = &instructions[instructions
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .unwrap()..];
    let user = last_stage
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the runtime stage sets USER");
    let uid: u32 = user
        .split(':')
        .next()
        .unwrap()
        .parse()
        .expect("numeric USER");
    assert_ne!(uid, 0, "non-root");
    assert!(last_stage.contains(&r#"ENTRYPOINT ["outboxd"]"#));
    assert!(last_stage.iter().any(
        |l| l.starts_with("HEALTHCHECK") && l.contains(r#"CMD ["outboxd", "probe", "ready"]"#)
    ));
    for label in ["title", "version", "licenses", "description"] {
        assert!(
            df.contains(&format!("org.opencontainers.image.{label}=")),
            "{label}"
        );
    }
    for l in &instructions {
        if l.starts_with("ENV ") || l.starts_with("ARG ") {
            let upper = l.to_ascii_uppercase();
            for word in ["PASSWORD", "SECRET", "TOKEN", "CREDENTIAL"] {
                assert!(!upper.contains(word), "a secret baked into the image: {l}");
            }
        }
    }
    // The runtime base (distroless cc) has glibc and libgcc; anything else the binary loads
    // must be copied in.
    let ldd = run_ok(Command::new("ldd").arg(relay_bin()))?;
    for lib in ldd.lines().filter_map(|l| l.split_whitespace().next()) {
        let base = [
            "linux-vdso",
            "libc.so",
            "libm.so",
            "libgcc_s",
            "ld-linux",
            "libpthread",
            "libdl",
            "librt",
        ];
        if !base
            .iter()
            .any(|b| lib.starts_with(b) || lib.contains("/ld-linux"))
        {
            assert!(
                df.contains(&format!("/usr/lib/{lib}")),
                "{lib} is not copied into the image"
            );
        }
    }
    let ignore = read(".dockerignore");
    for must in ["target/", ".dev/", ".git/", "deploy/compose/secrets/"] {
        assert!(
            ignore.lines().any(|l| l.trim() == must),
            ".dockerignore lacks {must}"
        );
    }
    Ok(())
}

/// The objects kubernetes-validate has no schema for (Prometheus Operator CRDs); checked by
/// hand below and by promtool.
const CRDS: [&str; 2] = ["ServiceMonitor", "PrometheusRule"];

/// Every overlay renders and validates (strict: unknown fields fail) against the Kubernetes
/// schemas offline; the pair is shaped as docs/deploy.md says.
#[test]
fn kubernetes_manifests_render_validate_and_form_pairs() -> Result<()> {
    let scratch = outboxd_testkit::tempdir("k8s-")?;
    for (overlay, pairs) in [
        ("overlays/one-pair", 1),
        ("overlays/many-databases", 2),
        ("base", 1),
    ] {
        let (text, docs) = kustomize(overlay)?;
        let file = scratch
            .path()
            .join(format!("{}.yaml", overlay.replace('/', "-")));
        std::fs::write(&file, &text)?;
        let out = Command::new("python3")
            .args([
                "-m",
                "kubernetes_validate",
                "--strict",
                "--kubernetes-version",
                "1.32.0",
            ])
            .arg(&file)
            .output()?;
        let report = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{overlay}: {report}");
        for line in report.lines().filter(|l| l.starts_with("WARN")) {
            assert!(
                CRDS.iter().any(|c| line.contains(&format!("kind {c} "))),
                "{overlay}: {line}"
            );
        }
        let deployments = of_kind(&docs, "Deployment");
        assert_eq!(deployments.len(), pairs, "{overlay}");
        let mut slots = Vec::new();
        for d in deployments {
            slots.push(check_pair(&docs, d)?);
        }
        slots.sort();
        slots.dedup();
        assert_eq!(
            slots.len(),
            pairs,
            "{overlay}: one slot per pair: {slots:?}"
        );
        if overlay != "base" {
            for crd in CRDS {
                assert_eq!(
                    of_kind(&docs, crd).len(),
                    1,
                    "{overlay}: one {crd} for all pairs"
                );
            }
            let sm = of_kind(&docs, "ServiceMonitor")[0];
            // Alerts are per pair: the pair's pod label becomes the `database` the rules
            // group by (the base config's [alerts] group_by).
            let relabel = &sm["spec"]["endpoints"][0]["relabelings"][0];
            assert_eq!(
                (s(&relabel["sourceLabels"][0]), s(&relabel["targetLabel"])),
                (
                    "__meta_kubernetes_pod_label_outboxd_io_database",
                    "database"
                ),
                "{overlay}: {sm}"
            );
            let want = sm["spec"]["selector"]["matchLabels"].as_object().unwrap();
            for svc in of_kind(&docs, "Service") {
                let labels = &svc["metadata"]["labels"];
                assert!(want.iter().all(|(k, v)| &labels[k] == v), "{svc}");
                let port = s(&sm["spec"]["endpoints"][0]["port"]);
                assert!(svc["spec"]["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["name"] == port));
            }
        }
    }
    Ok(())
}

/// One pair: two replicas on one slot, probes that keep a healthy standby, a drain that fits the
/// grace period, a PDB and a metrics Service over its pods, hardened containers, the config
/// from a ConfigMap and the password from a Secret as a file. Returns the pair's slot.
fn check_pair(docs: &[Value], d: &Value) -> Result<String> {
    let name = s(&d["metadata"]["name"]);
    let spec = &d["spec"];
    assert_eq!(spec["replicas"], 2, "{name}: active + standby");
    let pod = &spec["template"]["spec"];
    let labels = spec["template"]["metadata"]["labels"].as_object().unwrap();
    let selects = |sel: &Value| {
        sel.as_object()
            .is_some_and(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
    };
    assert!(selects(&spec["selector"]["matchLabels"]));
    assert_eq!(pod["automountServiceAccountToken"], false);
    let c = &pod["containers"][0];
    assert_eq!(
        c["readinessProbe"]["exec"]["command"],
        serde_json::json!(["outboxd", "probe", "ready"])
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"], "/healthz",
        "liveness never asks /readyz"
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert!(
        c["resources"]["requests"]["memory"].is_string()
            && c["resources"]["limits"]["memory"].is_string()
    );
    // The config: a ConfigMap mounted where OUTBOXD_CONFIG points; the env resolved from it.
    let scratch = outboxd_testkit::tempdir("pair-")?;
    let launch = outboxd_tests::deploy::launch_of(docs, pod, scratch.path())?;
    let cm_toml = outboxd_tests::deploy::config_map_file(docs, pod, "config", "outboxd.toml")?;
    let cfg = outboxd::Config::from_toml_and_env(&cm_toml, Vec::<(String, String)>::new())?;
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace * 1000 >= cfg.relay.shutdown_timeout_ms + 10_000,
        "{name}: grace {grace} s vs drain {} ms",
        cfg.relay.shutdown_timeout_ms
    );
    assert!(
        launch
            .env
            .keys()
            .all(|k| !k.contains("PASSWORD") || k.ends_with("_FILE")),
        "{name}: passwords only as files: {:?}",
        launch.env.keys()
    );
    let pw = &launch.env["OUTBOXD_SOURCE_PASSWORD_FILE"];
    let secret_mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| pw.starts_with(s(&m["mountPath"])))
        .expect("the password file is mounted");
    let vol = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == secret_mount["name"])
        .unwrap();
    assert!(vol["secret"]["secretName"].is_string(), "{vol}");
    // Every OUTBOXD_* variable of the relay and of its init Job reaches its setting.
    let mut pods = vec![pod];
    pods.extend(
        of_kind(docs, "Job")
            .into_iter()
            .map(|j| &j["spec"]["template"]["spec"]),
    );
    for p in pods {
        let l = outboxd_tests::deploy::launch_of(docs, p, scratch.path())?;
        let file = l.host_path(&l.env["OUTBOXD_SOURCE_PASSWORD_FILE"]).unwrap();
        std::fs::write(file, "pw")?;
        let toml = std::fs::read_to_string(outboxd_tests::deploy::config_of(&l)?)?;
        every_override_reaches_its_setting(&toml, &l.host_env(), scratch.path())?;
    }
    // PDB and Service select exactly this pair's pods.
    let ns_name = |o: &Value| s(&o["metadata"]["name"]).to_string();
    let pdb: Vec<&Value> = of_kind(docs, "PodDisruptionBudget")
        .into_iter()
        .filter(|p| selects(&p["spec"]["selector"]["matchLabels"]))
        .collect();
    assert_eq!(
        pdb.len(),
        1,
        "{name}: {:?}",
        pdb.iter().map(|p| ns_name(p)).collect::<Vec<_>>()
    );
    assert_eq!(pdb[0]["spec"]["maxUnavailable"], 1);
    let svc: Vec<&Value> = of_kind(docs, "Service")
        .into_iter()
        .filter(|p| selects(&p["spec"]["selector"]))
        .collect();
    assert_eq!(svc.len(), 1, "{name}");
    assert_eq!(svc[0]["spec"]["publishNotReadyAddresses"], true);
    Ok(launch.env["OUTBOXD_SOURCE_SLOT"].clone())
}

/// The PrometheusRule is `outboxd alerts` of the base config (prometheusrule.sh prints the same
/// today), and its rules — like docker-compose.yml's rule file — pass `promtool check rules`.
#[test]
fn alert_rules_are_generated_and_pass_promtool() -> Result<()> {
    let scratch = outboxd_testkit::tempdir("rules-")?;
    let generated = run_ok(
        Command::new("sh")
            .arg(repo().join("deploy/kubernetes/prometheusrule.sh"))
            .env("OUTBOXD", relay_bin()),
    )?;
    assert_eq!(
        generated,
        read("deploy/kubernetes/monitoring/prometheusrule.yaml"),
        "run deploy/kubernetes/prometheusrule.sh > deploy/kubernetes/monitoring/prometheusrule.yaml"
    );
    let rule = yaml_docs(&generated)?.remove(0);
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    let rules_file = scratch.path().join("k8s-rules.yaml");
    std::fs::write(&rules_file, serde_json::to_string(&rule["spec"])?)?;
    let compose_rules = repo().join("deploy/compose/outboxd-alerts.yml");
    let (_, alerts) =
        outboxd_tests::outboxd_cli(&["alerts"], &repo().join("deploy/compose/outboxd.toml"));
    assert!(
        read("deploy/compose/outboxd-alerts.yml").ends_with(&alerts),
        "regenerate deploy/compose/outboxd-alerts.yml (its first line says how)"
    );
    for f in [&rules_file, &compose_rules] {
        let out = run_ok(
            Command::new(tool("promtool"))
                .arg("check")
                .arg("rules")
                .arg(f),
        )?;
        assert!(out.contains("SUCCESS"), "{out}");
    }
    let compose = yaml_docs(&read("docker-compose.yml"))?.remove(0);
    let prom = s(&compose["configs"]["prometheus"]["content"]);
    assert!(
        prom.contains("rule_files: [/etc/prometheus/rules/outboxd.yml]"),
        "{prom}"
    );
    let mounts = compose["services"]["prometheus"]["volumes"].to_string();
    assert!(
        mounts.contains("./deploy/compose/outboxd-alerts.yml:/etc/prometheus/rules/outboxd.yml")
    );
    Ok(())
}
