//! Client addresses and guest session tokens.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use ipnet::IpNet;
use sha2::{Digest, Sha256};
use spendgate_core::IpScope;
use spendgate_listener::canonical;
use spendgate_wire::error::ApiError;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use subtle::ConstantTimeEq;

/// Longest session token accepted.
pub const SESSION_TOKEN_BYTES_MAX: usize = 256;
/// Most `X-Forwarded-For` entries looked at.
pub const FORWARDED_ENTRIES_MAX: usize = 32;

/// The client's address: the socket peer, unless the peer is a trusted proxy; then the
/// rightmost `X-Forwarded-For` entry that is not a trusted proxy.
pub fn client_addr(peer: SocketAddr, forwarded_for: Option<&str>, trusted: &[IpNet]) -> IpAddr {
    let peer = canonical(peer.ip());
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|n| n.contains(ip));
    if !is_trusted(&peer) {
        return peer;
    }
    let Some(xff) = forwarded_for else {
        return peer;
    };
    let entries: Vec<&str> = xff.rsplit(',').take(FORWARDED_ENTRIES_MAX).collect();
    let mut last = peer;
    for e in entries {
        let Some(ip) = forwarded_entry(e).map(canonical) else {
            // An unparseable hop: stop believing the chain here. A trusted hop wrote it, so
            // the operator should hear of it (every guest behind it shares that hop's address).
            warn_unparseable(e);
            return last;
        };
        if !is_trusted(&ip) {
            return ip;
        }
        last = ip;
    }
    last
}

/// An `X-Forwarded-For` entry as an address: a bare IPv4 or IPv6 address, or one with a port
/// as some proxies write it (`203.0.113.5:1234`, `[2001:db8::1]:443`, `[2001:db8::1]`). A
/// bare IPv6 address is never cut at a colon (`2001:db8::1:443` is an address, not a port).
pub fn forwarded_entry(entry: &str) -> Option<IpAddr> {
    let e = entry.trim();
    e.parse::<IpAddr>()
        .ok()
        .or_else(|| e.parse::<SocketAddr>().ok().map(|s| s.ip()))
        .or_else(|| {
            let bracketed = e.strip_prefix('[')?.strip_suffix(']')?;
            bracketed.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
        })
}

/// Least time between two warnings about unparseable `X-Forwarded-For` entries.
pub const FORWARDED_WARN_EVERY_S: u64 = 60;
/// Bytes of an unparseable entry quoted in the warning.
pub const FORWARDED_WARN_ENTRY_BYTES_MAX: usize = 64;

/// Logs (at most once per [`FORWARDED_WARN_EVERY_S`], with the number left unlogged) that a
/// trusted hop's `X-Forwarded-For` entry is not an address.
fn warn_unparseable(entry: &str) {
    static LAST: AtomicU64 = AtomicU64::new(0);
    static SKIPPED: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(Ordering::Relaxed);
    let due = last == 0 || now >= last.saturating_add(FORWARDED_WARN_EVERY_S);
    if !due
        || LAST
            .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        SKIPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let entry = entry.trim();
    let mut cut = entry.len().min(FORWARDED_WARN_ENTRY_BYTES_MAX);
    while !entry.is_char_boundary(cut) {
        cut -= 1;
    }
    tracing::warn!(
        entry = ?&entry[..cut],
        unlogged_since_last = SKIPPED.swap(0, Ordering::Relaxed),
        "an X-Forwarded-For entry from a trusted proxy is not an address: its clients are \
         counted under the proxy's own address; check that proxy's configuration"
    );
}

/// The address prefixes a client is limited by: IPv4 at `v4` bits; IPv6 at `v6` bits and at
/// each wider prefix with its factor.
pub fn ip_scopes(ip: IpAddr, v4: u8, v6: u8, v6_wider: &[(u8, u64)]) -> Vec<IpScope> {
    let ip = canonical(ip);
    let net = |bits: u8| {
        IpNet::new(ip, bits)
            .map(|n| n.trunc().to_string())
            .unwrap_or_else(|_| ip.to_string())
    };
    match ip {
        IpAddr::V4(_) => vec![IpScope {
            prefix: net(v4),
            factor: 1,
        }],
        IpAddr::V6(_) => {
            let mut v = vec![IpScope {
                prefix: net(v6),
                factor: 1,
            }];
            for (bits, factor) in v6_wider {
                if *bits < v6 {
                    v.push(IpScope {
                        prefix: net(*bits),
                        factor: *factor,
                    });
                }
            }
            v
        }
    }
}

/// The limit factor of an address prefix (`ip` scope id) as [`ip_scopes`] gives it: an IPv6
/// prefix at one of the wider lengths has that length's factor; any other prefix 1.
pub fn prefix_factor(prefix: &str, v6: u8, v6_wider: &[(u8, u64)]) -> u64 {
    match prefix.parse::<IpNet>() {
        Ok(IpNet::V6(n)) => v6_wider
            .iter()
            .find(|(bits, _)| *bits == n.prefix_len() && *bits < v6)
            .map_or(1, |(_, factor)| *factor),
        _ => 1,
    }
}

/// The `ip` scope id that admissions use for `text` (an address, or a prefix of one of the
/// counted lengths: IPv4 at `v4` bits, IPv6 at `v6` bits or a wider length in `v6_wider`),
/// so that an operator's adjustment lands on the counter admissions check. An address stands
/// for its narrowest counted prefix; host bits are cleared; an IPv4-mapped IPv6 address is
/// IPv4. `Err` says which prefixes are counted.
pub fn counted_prefix(
    text: &str,
    v4: u8,
    v6: u8,
    v6_wider: &[(u8, u64)],
) -> Result<String, String> {
    let bad = || {
        let wider: Vec<String> = v6_wider
            .iter()
            .filter(|(b, _)| *b < v6)
            .map(|(b, _)| format!("/{b}"))
            .collect();
        format!(
            "ip scope {text:?} is not an address or a counted prefix (IPv4 /{v4}, IPv6 /{v6}{}{})",
            if wider.is_empty() { "" } else { " or " },
            wider.join(", ")
        )
    };
    if let Ok(ip) = text.parse::<IpAddr>() {
        return ip_scopes(ip, v4, v6, v6_wider)
            .into_iter()
            .next()
            .map(|s| s.prefix)
            .ok_or_else(bad);
    }
    let net: IpNet = text.parse().map_err(|_| bad())?;
    let (ip, bits) = (canonical(net.addr()), net.prefix_len());
    let bits = match (net.addr(), ip) {
        // ::ffff:a.b.c.d/120 is a.b.c.d/24
        (IpAddr::V6(_), IpAddr::V4(_)) => bits.checked_sub(96).ok_or_else(bad)?,
        _ => bits,
    };
    let counted = match ip {
        IpAddr::V4(_) => bits == v4,
        IpAddr::V6(_) => bits == v6 || v6_wider.iter().any(|(b, _)| *b == bits && *b < v6),
    };
    if !counted {
        return Err(bad());
    }
    IpNet::new(ip, bits)
        .map(|n| n.trunc().to_string())
        .map_err(|_| bad())
}

/// Whether `id` is a session id as [`SessionKeys::issue`] makes them (128 random bits, 32
/// lowercase hex digits).
pub fn is_session_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Signs and verifies guest session tokens: `v1.KID.ID.EXP.MAC`, where ID is a random 128-bit
/// id, EXP the expiry in Unix seconds, KID names the key, MAC is HMAC-SHA256 over the rest.
/// The first key signs; every key verifies (rotation).
#[derive(Clone)]
pub struct SessionKeys {
    keys: Vec<(String, Vec<u8>)>,
    /// Longest lifetime a token may claim (`sessions.ttl_s`): lowering it shortens the
    /// tokens already issued too.
    max_ttl_s: u64,
}

/// Clock difference between replicas a token's expiry may carry beyond `max_ttl_s`.
pub const SESSION_CLOCK_SKEW_S: u64 = 300;

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKeys")
            .field("count", &self.keys.len())
            .finish()
    }
}

pub struct Session {
    pub id: String,
    pub expires_unix: u64,
}

fn kid_of(key: &[u8]) -> String {
    hex::encode(&Sha256::digest(key)[..4])
}

impl SessionKeys {
    pub fn new(keys: Vec<Vec<u8>>) -> Option<SessionKeys> {
        if keys.is_empty() || keys.iter().any(|k| k.len() < 16) {
            return None;
        }
        Some(SessionKeys {
            max_ttl_s: u64::MAX,
            keys: keys.into_iter().map(|k| (kid_of(&k), k)).collect(),
        })
    }

    fn mac(key: &[u8], payload: &str) -> Vec<u8> {
        // HMAC accepts keys of any length; this cannot fail.
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key).unwrap_or_else(|_| {
            <Hmac<Sha256> as KeyInit>::new_from_slice(&[0u8; 32]).expect("32-byte HMAC key")
        });
        m.update(payload.as_bytes());
        m.finalize().into_bytes().to_vec()
    }

    /// The key that signs (the first configured).
    pub fn signing_key(&self) -> &[u8] {
        &self.keys[0].1
    }

    /// Refuses tokens that claim to live longer than `ttl_s` from now (plus
    /// [`SESSION_CLOCK_SKEW_S`]).
    pub fn with_max_ttl(mut self, ttl_s: u64) -> SessionKeys {
        self.max_ttl_s = ttl_s;
        self
    }

    /// Every key that verifies, the signing key first.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.keys.iter().map(|(_, k)| k.as_slice())
    }

    pub fn issue(&self, now_unix: u64, ttl_s: u64) -> (String, Session) {
        let id: [u8; 16] = rand::random();
        let id_hex = hex::encode(id);
        let exp = now_unix.saturating_add(ttl_s);
        let (kid, key) = &self.keys[0];
        let payload = format!("v1.{kid}.{id_hex}.{exp}");
        let mac = B64.encode(Self::mac(key, &payload));
        (
            format!("{payload}.{mac}"),
            Session {
                id: id_hex,
                expires_unix: exp,
            },
        )
    }

    pub fn verify(&self, token: &str, now_unix: u64) -> Result<Session, ApiError> {
        let bad = || ApiError::unauthorized("invalid or expired session token");
        if token.len() > SESSION_TOKEN_BYTES_MAX {
            return Err(bad());
        }
        let (payload, mac) = token.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = payload.split('.').collect();
        let [v, kid, id, exp] = parts.as_slice() else {
            return Err(bad());
        };
        if *v != "v1" || id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let exp: u64 = exp.parse().map_err(|_| bad())?;
        let given = B64.decode(mac).map_err(|_| bad())?;
        let key = self.keys.iter().find(|(k, _)| k == kid).ok_or_else(bad)?;
        let expect = Self::mac(&key.1, payload);
        if !bool::from(expect.ct_eq(&given)) {
            return Err(bad());
        }
        let latest = now_unix
            .saturating_add(self.max_ttl_s)
            .saturating_add(SESSION_CLOCK_SKEW_S);
        if exp <= now_unix || exp > latest {
            return Err(bad());
        }
        Ok(Session {
            id: id.to_ascii_lowercase(),
            expires_unix: exp,
        })
    }
}

/// Compares a presented bearer token against the configured ones in constant time per token
/// (digests first, so lengths do not leak either).
pub fn token_matches(presented: &str, allowed: &[String]) -> bool {
    let p = Sha256::digest(presented.as_bytes());
    let mut ok = subtle::Choice::from(0);
    for a in allowed {
        let d = Sha256::digest(a.as_bytes());
        ok |= p.as_slice().ct_eq(d.as_slice());
    }
    bool::from(ok) && !allowed.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_addr_trusts_only_configured_proxies() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().expect("net")];
        let peer: SocketAddr = "10.1.2.3:5555".parse().expect("addr");
        let outside: SocketAddr = "198.51.100.9:5555".parse().expect("addr");
        assert_eq!(
            client_addr(peer, Some("203.0.113.5, 10.9.9.9"), &trusted).to_string(),
            "203.0.113.5"
        );
        assert_eq!(
            client_addr(peer, Some("1.1.1.1, 203.0.113.5"), &trusted).to_string(),
            "203.0.113.5",
            "rightmost untrusted entry, not the leftmost (spoofable) one"
        );
        assert_eq!(
            client_addr(outside, Some("203.0.113.5"), &trusted).to_string(),
            "198.51.100.9"
        );
        assert_eq!(client_addr(peer, None, &trusted).to_string(), "10.1.2.3");
        assert_eq!(
            client_addr(peer, Some("garbage"), &trusted).to_string(),
            "10.1.2.3"
        );
        let mapped: SocketAddr = "[::ffff:192.0.2.1]:1".parse().expect("addr");
        assert_eq!(client_addr(mapped, None, &[]).to_string(), "192.0.2.1");
        // Entries with a port (as some proxies write them) are the address without it.
        assert_eq!(
            client_addr(peer, Some("203.0.113.5:1234"), &trusted).to_string(),
            "203.0.113.5"
        );
        assert_eq!(
            client_addr(peer, Some("[2001:db8::1]:443, 10.0.0.2:80"), &trusted).to_string(),
            "2001:db8::1"
        );
    }

    #[test]
    fn forwarded_entries_with_and_without_ports() {
        let ip = |e: &str| forwarded_entry(e).map(|a| a.to_string());
        for (entry, want) in [
            ("203.0.113.5", Some("203.0.113.5")),
            (" 203.0.113.5:1234 ", Some("203.0.113.5")),
            ("[2001:db8::1]:443", Some("2001:db8::1")),
            ("[2001:db8::1]", Some("2001:db8::1")),
            ("2001:db8::1", Some("2001:db8::1")),
            // A bare IPv6 address is never cut at its last colon.
            ("2001:db8::1:443", Some("2001:db8::1:443")),
            ("::ffff:192.0.2.1", Some("::ffff:192.0.2.1")),
            ("[::ffff:192.0.2.1]:80", Some("::ffff:192.0.2.1")),
            ("203.0.113.5:", None),
            ("203.0.113.5:99999", None),
            ("203.0.113.5:+80", None),
            ("203.0.113.5:80:80", None),
            ("[203.0.113.5]:80", None),
            ("[2001:db8::1]443", None),
            ("[2001:db8::1", None),
            ("host.example:80", None),
            ("garbage", None),
            ("", None),
        ] {
            assert_eq!(ip(entry).as_deref(), want, "{entry:?}");
        }
    }

    #[test]
    fn prefixes() {
        let v4 = ip_scopes(
            "192.0.2.77".parse().expect("ip"),
            24,
            64,
            &[(56, 4), (48, 16)],
        );
        assert_eq!(
            v4,
            vec![IpScope {
                prefix: "192.0.2.0/24".into(),
                factor: 1
            }]
        );
        let v6 = ip_scopes(
            "2001:db8:1:2:3::1".parse().expect("ip"),
            32,
            64,
            &[(56, 4), (48, 16)],
        );
        let p: Vec<_> = v6.iter().map(|s| (s.prefix.as_str(), s.factor)).collect();
        assert_eq!(
            p,
            vec![
                ("2001:db8:1:2::/64", 1),
                ("2001:db8:1::/56", 4),
                ("2001:db8:1::/48", 16)
            ]
        );
        // An operator's adjustment of a prefix sees the factor its admissions see.
        for s in v4.iter().chain(&v6) {
            assert_eq!(prefix_factor(&s.prefix, 64, &[(56, 4), (48, 16)]), s.factor);
        }
        assert_eq!(prefix_factor("not a prefix", 64, &[(48, 16)]), 1);
    }

    #[test]
    fn session_tokens_verify_and_reject_tampering() {
        let keys = SessionKeys::new(vec![b"0123456789abcdef0123".to_vec()]).expect("keys");
        let (tok, s) = keys.issue(1000, 60);
        assert_eq!(keys.verify(&tok, 1001).expect("valid").id, s.id);
        assert!(keys.verify(&tok, 1060).is_err(), "expired");
        let mut t = tok.clone().into_bytes();
        let i = t.len() / 2;
        t[i] = if t[i] == b'a' { b'b' } else { b'a' };
        assert!(
            keys.verify(&String::from_utf8_lossy(&t), 1001).is_err(),
            "tampered"
        );
        assert!(keys.verify("", 1001).is_err());
        assert!(keys.verify("v1.x.y.z.w", 1001).is_err());
        // Rotation: a new first key signs, the old one still verifies.
        let rotated = SessionKeys::new(vec![
            b"another-key-0123456789".to_vec(),
            b"0123456789abcdef0123".to_vec(),
        ])
        .expect("keys");
        assert!(rotated.verify(&tok, 1001).is_ok());
        let other = SessionKeys::new(vec![b"another-key-0123456789".to_vec()]).expect("keys");
        assert!(other.verify(&tok, 1001).is_err());
        // A shorter ttl_s than the token was issued with ends it early.
        let (long, _) = keys.issue(1000, 86_400);
        let shortened = keys.clone().with_max_ttl(60);
        assert!(keys.verify(&long, 1001).is_ok());
        assert!(shortened.verify(&long, 1001).is_err(), "longer than ttl_s");
        assert!(shortened.verify(&long, 1000 + 86_400 - 360).is_ok());
    }

    #[test]
    fn tokens_compare() {
        let allowed = vec!["secret-a".to_string(), "secret-b".to_string()];
        assert!(token_matches("secret-b", &allowed));
        assert!(!token_matches("secret-c", &allowed));
        assert!(!token_matches("", &[]));
    }

    #[test]
    fn adjustments_name_the_prefix_admissions_count() {
        let wider = [(56u8, 4u64), (48, 16)];
        let p = |t: &str| counted_prefix(t, 24, 64, &wider);
        assert_eq!(p("203.0.113.7").as_deref(), Ok("203.0.113.0/24"));
        assert_eq!(p("203.0.113.7/24").as_deref(), Ok("203.0.113.0/24"));
        assert_eq!(p("::ffff:203.0.113.7").as_deref(), Ok("203.0.113.0/24"));
        assert_eq!(p("::ffff:203.0.113.0/120").as_deref(), Ok("203.0.113.0/24"));
        assert_eq!(p("2001:db8:1:2::77").as_deref(), Ok("2001:db8:1:2::/64"));
        assert_eq!(p("2001:db8::1/48").as_deref(), Ok("2001:db8::/48"));
        assert_eq!(p("2001:db8::/56").as_deref(), Ok("2001:db8::/56"));
        for bad in [
            "203.0.113.7/32",
            "2001:db8::/40",
            "not-an-ip",
            "",
            "10.0.0.0/33",
        ] {
            let e = p(bad).expect_err(bad);
            assert!(e.contains("/24") && e.contains("/48"), "{e}");
        }
        assert!(is_session_id("0123456789abcdef0123456789abcdef"));
        assert!(!is_session_id("0123456789ABCDEF0123456789abcdef"));
        assert!(!is_session_id("abc"));
    }
}
