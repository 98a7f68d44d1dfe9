//! Run and step ids: made here, checked where a request names one (a path: [`crate::path`];
//! the proxy's `Spendgate-Run` header).

use spendgate_core::ID_BYTES_MAX;
use spendgate_wire::error::{ApiError, ApiResult};

/// A new run or step id: the prefix, the wall clock in milliseconds (12 hex digits, fixed
/// width), then 128 random bits (what makes it unguessable). Ids made later sort later, so
/// the sqlite store's rows of new runs and steps are appended near the end of its B-tree
/// instead of landing on a random page each: a page written per new row was most of the
/// bytes the disk took per step (see BENCHMARKS.md, eleventh session).
pub fn new_id(prefix: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let random: [u8; 16] = rand::random();
    format!(
        "{prefix}_{:012x}{}",
        ms & 0xffff_ffff_ffff,
        hex::encode(random)
    )
}

/// Whether `id` could be an id of `what` that this gateway made: not empty, at most
/// [`ID_BYTES_MAX`] bytes, ASCII letters, digits, `_`, `.` and `-`. Any other is answered
/// `not_found`, as an id never made is (the store is not asked).
pub fn check_id(what: &str, id: &str) -> ApiResult<()> {
    if id.is_empty()
        || id.len() > ID_BYTES_MAX
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
    {
        return Err(ApiError::not_found(format!("{what} {id:?} not found")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new id is the prefix, 12 hex digits of milliseconds and 32 random hex digits: ids
    /// made later sort later (a millisecond apart at least), and no two are alike.
    #[test]
    fn new_ids_sort_by_time_and_stay_unguessable() {
        let a = new_id("stp");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_id("stp");
        for id in [&a, &b] {
            let hex = id.strip_prefix("stp_").expect("prefix");
            assert_eq!(hex.len(), 12 + 32, "{id}");
            assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
            assert!(id.len() <= spendgate_core::ID_BYTES_MAX);
        }
        assert!(a < b, "{a} then {b}");
        assert_ne!(a[16..], b[16..], "the random part differs");
        let same_ms: std::collections::HashSet<String> = (0..1000).map(|_| new_id("run")).collect();
        assert_eq!(same_ms.len(), 1000);
    }
}
