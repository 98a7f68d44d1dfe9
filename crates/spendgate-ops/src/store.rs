//! `spendgate store` commands' reports.

use spendgate_config::Config;

/// What `store init` says: what it found or did, and, last, the line to pin.
pub fn init_report(cfg: &Config, done: &spendgate_redis::Initialised) -> String {
    use spendgate_redis::Initialised;
    let prefix = &cfg.store.prefix;
    let pinned = cfg.store.ledger_id.as_deref();
    let what = match (done, pinned) {
        (Initialised::Created { ledger, kept_data }, Some(old)) => format!(
            "created a NEW ledger {ledger} under store.prefix {prefix:?}, replacing ledger {old} \
             that the config pins ({}). Replicas pinned to {old} keep refusing until their \
             config pins the new id; a replica's witness file of the old ledger stops it at \
             start until it is moved away.",
            if *kept_data {
                "the data the prefix held is kept: spend recorded there still counts"
            } else {
                "budgets start from zero"
            }
        ),
        (Initialised::Created { ledger, kept_data }, None) => format!(
            "created ledger {ledger} under store.prefix {prefix:?}{}.",
            if *kept_data {
                " (the data the prefix held is kept: spend recorded there still counts)"
            } else {
                ""
            }
        ),
        (Initialised::Pinned { ledger }, _) => {
            format!("store.prefix {prefix:?} holds the pinned ledger {ledger}: nothing changed.")
        }
        (Initialised::Found { ledger }, _) => {
            format!("store.prefix {prefix:?} already holds ledger {ledger}: nothing changed.")
        }
        (Initialised::Adopted { ledger }, _) => format!(
            "store.prefix {prefix:?} held a ledger made before ledger ids; it is now ledger \
             {ledger} (its data and epoch unchanged)."
        ),
    };
    let pin = match done {
        Initialised::Pinned { .. } => String::new(),
        _ => "\nPin it in the config of every replica (`spendgate serve` refuses a redis store \
              without it; a routine `store init` with it pinned then changes nothing and \
              refuses if the ledger is ever lost):\n\n[store]\n"
            .to_string(),
    };
    format!("{what}\n{pin}ledger_id = \"{}\"\n", done.ledger())
}
