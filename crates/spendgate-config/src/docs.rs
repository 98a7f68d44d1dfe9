//! The config reference (`docs/configuration.md`) and the annotated example
//! (`docs/spendgate.example.toml`), generated from the schema ([`crate::schema`]): the keys,
//! their types, ranges and docs come from the raw structs, their defaults from the effective
//! config of an empty file.

use crate::diagnostics::KeyPath;
use crate::raw::RawConfig;
use crate::render::{Mode, Writer};
use crate::schema::{Key, Table, Ty, ROOT};
use toml::Value;

/// The entries of the example's `[models]`, `[tools]` and `[upstreams]` (every other table
/// of the example is the defaults).
const EXAMPLE_ENTRIES: &str = r#"
[models."gpt-4o-mini"]
upstream = "openai"
input_per_million = "0.15"
output_per_million = "0.60"
cached_input_per_million = "0.075"
tokenizer = "o200k_base"

[tools.web_search]
per_call = "0.01"

[upstreams.openai]
base_url = "https://api.openai.com/v1"
api_key = "env:OPENAI_API_KEY"
"#;

const EXAMPLE_HEADER: &str = "\
# spendgate: an annotated example config (`spendgate config example` prints it).
#
# Every key is here, with what it does. A key commented out shows the value it takes when
# left out; a key set shows its default, except under [models], [tools] and [upstreams],
# whose entries are examples. `spendgate check-config --config FILE` validates a file and
# prints its effective config. Amounts are decimal strings in currency units; secrets are
# literals or \"env:NAME\", read from the environment at start. The reference:
# docs/configuration.md (`spendgate config reference`).
";

/// An annotated example config: every table and key with its doc as comments, the defaults
/// set (or shown commented out where leaving the key out means more than its value), and a
/// model, its upstream and a paid tool. `spendgate check-config` accepts it.
pub fn example_toml() -> String {
    let config = match crate::load(EXAMPLE_ENTRIES, &|_| None) {
        Ok(c) => c,
        Err(e) => return format!("# the example does not load: {e}\n"),
    };
    let written = toml::from_str::<RawConfig>(EXAMPLE_ENTRIES)
        .map_err(|e| e.to_string())
        .and_then(|raw| toml::Table::try_from(raw).map_err(|e| e.to_string()));
    let written = match written {
        Ok(w) => w,
        Err(e) => return format!("# the example cannot be written: {e}\n"),
    };
    let (raw, _) = config.to_raw();
    let mut w = Writer::new(Mode::Example { written: &written });
    w.line(EXAMPLE_HEADER.trim_end());
    w.document(&raw)
}

const REFERENCE_INTRO: &str = "\
# Configuration reference

<!-- Generated from the schema in crates/spendgate-config/src/raw.rs by `spendgate config
reference`; do not edit. `SPENDGATE_BLESS=1 cargo test -p spendgate-config` rewrites it. -->

spendgate reads one TOML file: `spendgate serve --config FILE` (or `-c FILE`, or the
`SPENDGATE_CONFIG` variable). Every key has a default, so an empty file, or none, is valid.
`spendgate check-config --config FILE` validates a file and prints the effective config,
secrets masked. [spendgate.example.toml](spendgate.example.toml) (`spendgate config example`)
is an annotated example with every key.

- An unknown key is an error, and so is a value of the wrong type or out of range; every error
  names the key (`limits.global.budgets[1].amount`) and its line.
- Amounts are decimal strings in currency units (`\"0.15\"`), parsed exactly to millionths
  (micros). An integer is accepted; a float is not (`0.1` as a float is not 0.1).
- Rates are `\"N/second\"`, `\"N/minute\"`, `\"N/hour\"` or `\"N/day\"`.
- Secrets (tokens, session keys, the Redis URL, API keys, the verifier secret, the webhook URL)
  are literals or `\"env:NAME\"`, read from the environment at start. An `env:` variable that is
  unset or empty drops its entry from a token or key list, is an error for
  `alerts.webhook_url`, and is an empty value elsewhere; the start warnings and check-config
  name every such variable.
- Ranges are inclusive. A default marked *not set* means the key is absent; what its absence
  means is said beside it.
";

/// The config reference (Markdown): every table and key, its type and range, its default and
/// what it does.
pub fn reference_markdown() -> String {
    let defaults = match crate::load("", &|_| None) {
        Ok(c) => c.to_raw().0,
        Err(e) => return format!("the defaults do not load: {e}\n"),
    };
    let defaults = match toml::Table::try_from(&defaults) {
        Ok(d) => d,
        Err(e) => return format!("the defaults cannot be written: {e}\n"),
    };
    let mut md = Markdown(REFERENCE_INTRO.to_string());
    let Ty::Table(root) = &ROOT else {
        return md.0;
    };
    md.contents(root);
    for key in root.keys {
        let path = KeyPath::of(&[key.name]);
        let values = defaults.get(key.name).and_then(Value::as_table);
        match &key.ty {
            Ty::Table(t) => match shared(t) {
                Some(scope) => md.scopes(&path, key, t, scope, values),
                None => md.section(&format!("[{path}]"), key, t, |k| {
                    default_text(k, values.and_then(|v| v.get(k.name)))
                }),
            },
            Ty::Map(Ty::Table(t)) => {
                let defaults = (t.defaults)();
                md.section(&format!("[{path}.NAME]"), key, t, |k| {
                    default_text(k, defaults.get(k.name))
                });
            }
            _ => {}
        }
    }
    md.0
}

/// The table every key of `t` holds, when they all hold the same one (`[limits.X]`).
fn shared(t: &Table) -> Option<&'static Table> {
    let mut tables = t.keys.iter().map(|k| match &k.ty {
        Ty::Table(sub) => Some(*sub),
        _ => None,
    });
    let first = tables.next()??;
    tables
        .all(|sub| sub.is_some_and(|sub| std::ptr::eq(sub, first)))
        .then_some(first)
}

/// A default as the reference shows it.
fn default_text(key: &Key, value: Option<&Value>) -> String {
    match value {
        Some(v) => format!("`{v}`"),
        None if key.required => "required".to_string(),
        None => "*not set*".to_string(),
    }
}

/// GitHub's anchor of a heading.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

struct Markdown(String);

impl Markdown {
    fn line(&mut self, s: impl AsRef<str>) {
        self.0.push_str(s.as_ref());
        self.0.push('\n');
    }

    fn doc(&mut self, key: &Key) {
        for l in key.doc_lines() {
            self.line(l);
        }
    }

    /// The list of sections.
    fn contents(&mut self, root: &Table) {
        self.line("");
        for key in root.keys {
            let heading = self.heading_of(key);
            self.line(format!("- [`{heading}`](#{})", anchor(&heading)));
        }
    }

    fn heading_of(&self, key: &Key) -> String {
        match &key.ty {
            Ty::Map(_) => format!("[{}.NAME]", key.name),
            Ty::Table(t) if shared(t).is_some() => format!("[{}.SCOPE]", key.name),
            _ => format!("[{}]", key.name),
        }
    }

    /// A table: its doc, a table of its keys' types and defaults, then what each key does.
    fn section(
        &mut self,
        heading: &str,
        key: &Key,
        table: &Table,
        default: impl Fn(&Key) -> String,
    ) {
        self.line("");
        self.line(format!("## `{heading}`"));
        self.line("");
        self.doc(key);
        self.line("");
        self.line("| Key | Type | Default |");
        self.line("|---|---|---|");
        for k in table.keys {
            self.line(format!(
                "| `{}` | {} | {} |",
                k.name,
                k.ty.summary(),
                default(k)
            ));
        }
        self.key_docs(table);
    }

    /// Tables of one kind under one key (`[limits.X]`): a column of defaults per table.
    fn scopes(
        &mut self,
        path: &KeyPath,
        key: &Key,
        scopes: &Table,
        table: &Table,
        values: Option<&toml::Table>,
    ) {
        self.line("");
        self.line(format!("## `[{path}.SCOPE]`"));
        self.line("");
        self.doc(key);
        self.line("");
        for scope in scopes.keys {
            let doc: Vec<&str> = scope.doc_lines().collect();
            self.line(format!("- `[{path}.{}]`: {}", scope.name, doc.join(" ")));
        }
        self.line("");
        let names: Vec<String> = scopes
            .keys
            .iter()
            .map(|s| format!("`{}`", s.name))
            .collect();
        self.line(format!("| Key | Type | {} |", names.join(" | ")));
        self.line(format!("|---|---|{}", "---|".repeat(names.len())));
        for k in table.keys {
            let defaults: Vec<String> = scopes
                .keys
                .iter()
                .map(|s| {
                    let v = values
                        .and_then(|v| v.get(s.name))
                        .and_then(Value::as_table)
                        .and_then(|v| v.get(k.name));
                    default_text(k, v)
                })
                .collect();
            self.line(format!(
                "| `{}` | {} | {} |",
                k.name,
                k.ty.summary(),
                defaults.join(" | ")
            ));
        }
        self.key_docs(table);
    }

    /// What each key does; the keys of a list's tables after it.
    fn key_docs(&mut self, table: &Table) {
        self.line("");
        for k in table.keys {
            let mut lines = k.doc_lines();
            let first = lines.next().unwrap_or_default();
            self.line(format!("- **`{}`**: {first}", k.name));
            for l in lines {
                self.line(format!("  {l}"));
            }
        }
        for k in table.keys {
            if let Ty::List {
                of: Ty::Table(entry),
                ..
            } = &k.ty
            {
                self.line("");
                self.line(format!("Each entry of `{}`:", k.name));
                self.line("");
                self.line("| Key | Type | Default |");
                self.line("|---|---|---|");
                let defaults = (entry.defaults)();
                for e in entry.keys {
                    self.line(format!(
                        "| `{}` | {} | {} |",
                        e.name,
                        e.ty.summary(),
                        default_text(e, defaults.get(e.name))
                    ));
                }
                self.key_docs(entry);
            }
        }
    }
}
