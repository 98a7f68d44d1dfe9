//! The start-up check of the planted bug named by `SPENDGATE_PLANT` (for the chaos run's
//! tests only): the switches themselves are `spendgate_wire::plant`'s; this module knows
//! them and the ledger script's (`spendgate_redis::plant`), so it refuses a name neither
//! knows and says loudly which bug is planted.

/// Every plant name this build knows: the server's and the ledger script's.
#[cfg(feature = "planted-bugs")]
pub fn names() -> Vec<&'static str> {
    spendgate_wire::plant::Plant::ALL
        .iter()
        .map(|p| p.name())
        .chain(spendgate_redis::plant::PLANTS.iter().map(|(n, _, _)| *n))
        .collect()
}

/// At start: refuses an unknown plant name (a typo must not run a test without its bug) and
/// says loudly, on stderr, which bug is planted.
#[cfg(feature = "planted-bugs")]
pub fn announce() -> Result<(), String> {
    let Some(name) = spendgate_wire::plant::active() else {
        return Ok(());
    };
    if !names().contains(&name) {
        return Err(format!(
            "{}={name:?} names no planted bug; known: {}",
            spendgate_redis::plant::PLANT_ENV,
            names().join(", ")
        ));
    }
    tracing::warn!(
        plant = name,
        "PLANTED BUG ACTIVE: this process is broken on purpose"
    );
    eprintln!("spendgate: PLANTED BUG ACTIVE: {name}");
    Ok(())
}

/// Without the feature there is nothing to announce (the variable is not read).
#[cfg(not(feature = "planted-bugs"))]
pub fn announce() -> Result<(), String> {
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The server's switches and the ledger script's read the same variable.
    #[test]
    fn one_variable_names_every_plant() {
        assert_eq!(
            spendgate_wire::plant::PLANT_ENV,
            spendgate_redis::plant::PLANT_ENV
        );
    }
}
