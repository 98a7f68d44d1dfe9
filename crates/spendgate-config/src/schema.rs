//! The config file's schema, in one place: every table and key with its type, default and
//! documentation.
//!
//! The raw structs (`raw.rs`) are declared with [`table!`], which keeps each key's doc comment,
//! type and default beside its field and generates, besides the serde struct and its
//! `Default`, a [`Table`] of [`Key`]s. Everything that needs to know the keys reads those
//! tables: the effective-config renderer and the annotated example (`render.rs`), the
//! reference (`docs.rs`), the diagnostics (unknown keys, what a key expects) and the
//! validator's ranges and choices.

use crate::diagnostics::{KeyPath, Seg};
use crate::raw::RawConfig;

/// Declares a table of the config file: a serde struct (`deny_unknown_fields`, every key
/// defaulted), its `Default` and its schema `TABLE`. Each field is
///
/// ```text
/// /// What the key does (the reference and the example print this).
/// #[key(TY)]                          or #[key(TY, required: true)], #[key(TY, example: Some("…"))]
/// name: RustType = default_expression,
/// ```
///
/// where `TY` is the key's [`Ty`]: what the file may write there, and its static range.
macro_rules! table {
    (
        $(#[doc = $tdoc:literal])*
        struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                #[key($ty:expr $(, $flag:ident: $val:expr)*)]
                $field:ident: $fty:ty = $default:expr,
            )*
        }
    ) => {
        $(#[doc = $tdoc])*
        #[derive(Debug, serde::Deserialize, serde::Serialize)]
        #[serde(deny_unknown_fields, default)]
        pub(crate) struct $name {
            $( $(#[doc = $doc])* pub(crate) $field: $fty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $( $field: $default, )* }
            }
        }

        impl $name {
            /// The keys of this table, in file order.
            pub(crate) const TABLE: $crate::schema::Table = $crate::schema::Table {
                defaults: || toml::Table::try_from($name::default()).unwrap_or_default(),
                keys: &[$(
                    $crate::schema::Key {
                        name: stringify!($field),
                        doc: concat!($($doc, "\n"),*),
                        ty: $ty,
                        $($flag: $val,)*
                        ..$crate::schema::Key::PLAIN
                    },
                )*],
            };
        }
    };
}
pub(crate) use table;

/// A table of the file: its keys, in file order.
#[derive(Debug)]
pub(crate) struct Table {
    pub(crate) keys: &'static [Key],
    /// The struct's `Default`, as TOML: the keys that have a default value.
    pub(crate) defaults: fn() -> toml::Table,
}

impl Table {
    pub(crate) fn key(&self, name: &str) -> Option<&'static Key> {
        self.keys.iter().find(|k| k.name == name)
    }
}

/// One key of a table.
#[derive(Debug)]
pub(crate) struct Key {
    pub(crate) name: &'static str,
    /// The doc comment, one line per source line.
    pub(crate) doc: &'static str,
    pub(crate) ty: Ty,
    /// Must be given (in its `[models.NAME]`, `[upstreams.NAME]` or budget table); else the
    /// key has a default or its absence means something (its doc says what).
    pub(crate) required: bool,
    /// A value to show, commented out, in the example, for a key with no default.
    pub(crate) example: Option<&'static str>,
}

impl Key {
    /// The defaults of [`table!`]'s optional flags.
    pub(crate) const PLAIN: Key = Key {
        name: "",
        doc: "",
        ty: Ty::Bool,
        required: false,
        example: None,
    };

    /// The doc comment's lines, without the space after `///`.
    pub(crate) fn doc_lines(&self) -> impl Iterator<Item = &'static str> {
        self.doc.lines().map(|l| l.strip_prefix(' ').unwrap_or(l))
    }
}

/// What the file may write for a key.
#[derive(Debug)]
pub(crate) enum Ty {
    Bool,
    /// A non-negative integer in `min..=max` (a key may be bounded further by another key: its
    /// doc says so).
    Int {
        min: u64,
        max: u64,
    },
    /// A number (alert thresholds).
    Fraction,
    /// A string of this form (a noun phrase: "an address and port such as …").
    Str(&'static str),
    /// One of these strings.
    Choice(&'static [&'static str]),
    /// An amount in currency units, as a decimal string (or an integer).
    Amount,
    /// A rate (`"N/second"`, `"N/minute"`, `"N/hour"`, `"N/day"`) or `"off"`.
    Rate,
    /// An integer in `min..=max`, or `"off"`.
    CountOrOff {
        min: u64,
        max: u64,
    },
    /// A secret of this form: a literal or `env:NAME`, never echoed in an error.
    Secret(&'static str),
    /// An array of at most `max` values of one type.
    List {
        of: &'static Ty,
        max: usize,
    },
    /// A table of known keys.
    Table(&'static Table),
    /// Tables by name (`[models.NAME]`), each of this type.
    Map(&'static Ty),
}

/// The file as a whole.
pub(crate) static ROOT: Ty = Ty::Table(&RawConfig::TABLE);

impl Ty {
    /// What a value of this type is, after "expected" in an error.
    pub(crate) fn expected(&self) -> String {
        match self {
            Ty::Bool => "true or false".to_string(),
            Ty::Int { min, max } => format!("an integer in {min}..={max}"),
            Ty::Fraction => "a number".to_string(),
            Ty::Str(form) => format!("{form} (a string)"),
            Ty::Choice(names) => format!("one of {}", quoted(names)),
            Ty::Amount => "an amount as a decimal string such as \"0.15\"".to_string(),
            Ty::Rate => {
                "a rate such as \"100/second\" (per second, minute, hour or day) or \"off\""
                    .to_string()
            }
            Ty::CountOrOff { min, max } => format!("an integer in {min}..={max} or \"off\""),
            Ty::Secret(form) => format!("{form} or \"env:NAME\" (a string)"),
            Ty::List { of, max } => format!("an array of at most {max}, each {}", of.expected()),
            Ty::Table(_) => "a table".to_string(),
            Ty::Map(_) => "a table of named tables".to_string(),
        }
    }

    /// The type as the reference shows it (Markdown).
    pub(crate) fn summary(&self) -> String {
        match self {
            Ty::Bool => "boolean".to_string(),
            Ty::Int { min, max } => format!("integer, {min} to {max}"),
            Ty::Fraction => "number".to_string(),
            Ty::Str(form) => format!("string: {form}"),
            Ty::Choice(names) => {
                let names: Vec<String> = names.iter().map(|n| format!("`\"{n}\"`")).collect();
                format!("one of {}", names.join(", "))
            }
            Ty::Amount => "amount: a decimal string in currency units".to_string(),
            Ty::Rate => {
                "rate: `\"N/second\"`, `\"N/minute\"`, `\"N/hour\"`, `\"N/day\"`, or `\"off\"`"
                    .to_string()
            }
            Ty::CountOrOff { min, max } => format!("integer, {min} to {max}, or `\"off\"`"),
            Ty::Secret(form) => format!("secret: {form}, or `\"env:NAME\"`"),
            Ty::List {
                of: Ty::Table(_),
                max,
            } => format!("array of at most {max} tables (below)"),
            Ty::List { of, max } => format!("array of at most {max}, each {}", of.summary()),
            Ty::Table(_) => "table".to_string(),
            Ty::Map(_) => "tables by name".to_string(),
        }
    }

    /// Values of this type (or in an array of it) are never echoed: errors reach logs.
    pub(crate) fn is_secret(&self) -> bool {
        match self {
            Ty::Secret(_) => true,
            Ty::List { of, .. } => of.is_secret(),
            _ => false,
        }
    }

    /// Holds tables: written as `[sections]`, not as `key = value`.
    pub(crate) fn is_section(&self) -> bool {
        matches!(self, Ty::Table(_) | Ty::Map(_))
    }
}

/// `"a", "b", "c"`.
pub(crate) fn quoted(names: &[&str]) -> String {
    let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    names.join(", ")
}

/// Where a key path leads in the schema.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// The type at the path.
    Found { ty: &'static Ty },
    /// The first `known` segments lead to `table`, which has no key named by the next one.
    Unknown { known: usize, table: &'static Table },
    /// The first `known` segments lead to a value that holds no keys or elements.
    TooDeep { known: usize },
}

/// Follows `path` through the schema.
pub(crate) fn lookup(path: &KeyPath) -> Lookup {
    let mut ty: &'static Ty = &ROOT;
    for (i, seg) in path.segs().iter().enumerate() {
        match (ty, seg) {
            (Ty::Table(t), Seg::Key(name)) => match t.key(name) {
                Some(k) => ty = &k.ty,
                None => return Lookup::Unknown { known: i, table: t },
            },
            (Ty::Map(of), Seg::Key(_)) | (Ty::List { of, .. }, Seg::Index(_)) => ty = of,
            _ => return Lookup::TooDeep { known: i },
        }
    }
    Lookup::Found { ty }
}

/// The known name nearest to `name`, if one is near enough to be meant: a slip of the
/// keyboard (at most one edit in four characters, and at least one), or a known name that
/// begins the other or is begun by it (`listen_addr`, `listen`).
pub(crate) fn nearest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (name.chars().count() / 4).max(1);
    let begins = |k: &str| {
        let (short, long) = if k.len() < name.len() {
            (k, name)
        } else {
            (name, k)
        };
        short.len() >= 4 && long.starts_with(short)
    };
    known
        .into_iter()
        .map(|k| (edit_distance(name, k), k))
        .filter(|(d, k)| *d <= limit || begins(k))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Edits from `a` to `b`, by characters: insertions, deletions, substitutions and swaps of
/// two neighbours (optimal string alignment distance).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}
