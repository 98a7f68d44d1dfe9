//! The generated docs: checked in, and the example valid.

use super::*;
use crate::schema::{Table, Ty, ROOT};

/// `docs/NAME` in the repository.
fn doc_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs")
        .join(name)
}

/// The checked-in file equals `generated`; with `SPENDGATE_BLESS=1` it is rewritten instead.
fn check_in(name: &str, generated: &str) {
    let path = doc_path(name);
    if std::env::var_os("SPENDGATE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, generated).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != generated {
        let line = on_disk
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || on_disk.lines().count().min(generated.lines().count()) + 1,
                |i| i + 1,
            );
        panic!(
            "docs/{name} differs from what the config schema generates (first at line {line}); \
             regenerate it with `SPENDGATE_BLESS=1 cargo test -p spendgate-config` and commit it"
        );
    }
}

#[test]
fn docs_configuration_md_is_generated_from_the_schema() {
    check_in("configuration.md", &reference_markdown());
}

#[test]
fn docs_example_toml_is_generated_from_the_schema() {
    check_in("spendgate.example.toml", &example_toml());
}

/// Every table of the schema with its path (`limits.global`, `models.NAME`, and the budget
/// tables as `limits.global.budgets[]`).
fn tables() -> Vec<(String, &'static Table)> {
    fn walk(path: String, t: &'static Table, out: &mut Vec<(String, &'static Table)>) {
        out.push((path.clone(), t));
        for k in t.keys {
            let sub = if path.is_empty() {
                k.name.to_string()
            } else {
                format!("{path}.{}", k.name)
            };
            match &k.ty {
                Ty::Table(t) => walk(sub, t, out),
                Ty::Map(Ty::Table(t)) => walk(format!("{sub}.NAME"), t, out),
                Ty::List {
                    of: Ty::Table(t), ..
                } => walk(format!("{sub}[]"), t, out),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    if let Ty::Table(root) = &ROOT {
        walk(String::new(), root, &mut out);
    }
    out
}

#[test]
fn every_key_has_a_doc_and_appears_in_the_reference_and_the_example() {
    let reference = reference_markdown();
    let example = example_toml();
    let mut keys = 0;
    for (path, table) in tables() {
        for k in table.keys {
            keys += 1;
            assert!(
                k.doc_lines().any(|l| !l.trim().is_empty()),
                "{path}.{} has no doc comment in raw.rs",
                k.name
            );
            if k.ty.is_section() {
                continue;
            }
            assert!(
                reference.contains(&format!("| `{}` | {} |", k.name, k.ty.summary())),
                "{path}.{} is not in the reference",
                k.name
            );
            assert!(
                example.contains(&format!("{} = ", k.name)),
                "{path}.{} is not in the example",
                k.name
            );
        }
    }
    assert!(keys > 80, "{keys} keys: the walk missed tables");
}

/// Loads with `SPENDGATE_VERIFIER_SECRET` set (the example's verifier secret, commented out).
fn env(name: &str) -> Option<String> {
    (name == "SPENDGATE_VERIFIER_SECRET").then(|| "verifier-secret-0123456789".to_string())
}

/// `text` with every commented-out `key = value` line of a schema key uncommented.
fn uncommented(text: &str) -> String {
    let names: Vec<&str> = tables()
        .iter()
        .flat_map(|(_, t)| t.keys.iter().map(|k| k.name))
        .collect();
    let mut out = String::new();
    for line in text.lines() {
        let kv = line.strip_prefix("# ").filter(|kv| {
            toml::from_str::<toml::Table>(kv)
                .is_ok_and(|t| t.len() == 1 && t.keys().all(|k| names.contains(&k.as_str())))
        });
        out.push_str(kv.unwrap_or(line));
        out.push('\n');
    }
    out
}

#[test]
fn the_example_is_a_valid_config_of_the_defaults_and_its_entries() {
    let example = example_toml();
    let c = load(&example, &env).unwrap_or_else(|e| panic!("{e}\n{example}"));
    let d = load("", &env).expect("the defaults");
    assert_eq!(c.server, d.server);
    assert_eq!(c.store, d.store);
    assert_eq!(c.sessions, d.sessions);
    assert_eq!(c.identity, d.identity);
    assert_eq!(c.policy, d.policy);
    assert_eq!(c.alerts, d.alerts);
    let names = |m: Vec<&String>| m.into_iter().cloned().collect::<Vec<String>>();
    assert_eq!(names(c.models.keys().collect()), ["gpt-4o-mini"]);
    assert_eq!(names(c.tools.keys().collect()), ["web_search"]);
    assert_eq!(names(c.upstreams.keys().collect()), ["openai"]);
    // The model's upstream is a real one (`serve` refuses the mock), and its price is under
    // the run's cost bound: nothing in the example is unusable.
    let warnings = c.warnings();
    assert!(
        !warnings
            .iter()
            .any(|w| w.starts_with("models.") || w.starts_with("run.")),
        "{warnings:?}"
    );

    // Every key commented out shows the value it takes when left out: uncommented, the
    // config is the same, but for the keys whose value is only an example.
    let all = uncommented(&example);
    assert!(all.contains("\nverifier_url = "), "{all}");
    let u = load(&all, &env).unwrap_or_else(|e| panic!("{e}\n{all}"));
    assert_eq!(u.server, c.server);
    assert_eq!(u.store, c.store);
    assert_eq!(u.identity, c.identity);
    assert_eq!(u.policy, c.policy);
    assert_eq!(u.tools, c.tools);
    assert_eq!(u.alerts, c.alerts);
    assert!(u.sessions.verifier_url.is_some());
    assert_eq!(
        u.models["gpt-4o-mini"].upstream_model.as_deref(),
        Some("gpt-4o-mini-2024-07-18")
    );
}

#[test]
fn the_reference_shows_the_defaults_of_each_scope() {
    let reference = reference_markdown();
    assert!(
        reference.contains(
            "| `rate` | rate: `\"N/second\"`, `\"N/minute\"`, `\"N/hour\"`, `\"N/day\"`, or \
             `\"off\"` | `\"100/second\"` | `\"30/minute\"` | `\"20/minute\"` | `\"off\"` |"
        ),
        "{reference}"
    );
    assert!(
        reference.contains("| `timeout_ms` | integer, 1 to 5000 | `100` |"),
        "{reference}"
    );
    assert!(
        reference.contains("| `base_url` | string: an http:// or https:// URL | required |"),
        "{reference}"
    );
}
