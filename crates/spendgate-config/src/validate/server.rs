//! Validation of `[server]`, `[store]`, `[sessions]` and `[identity]`.

use super::{Resolved, Validator, R};
use crate::diagnostics::{toml_str, KeyPath};
use crate::raw::{RawIdentity, RawServer, RawSessions, RawStore};
use crate::{
    CapacityConfig, ChallengeMode, IdentityConfig, Secret, ServerConfig, SessionsConfig,
    StoreConfig, StoreKind, ADDRESS_CONNECTIONS_MAX_DEFAULT, CONNECTIONS_RESERVED_DEFAULT,
    SESSION_KEY_BYTES_MIN,
};
use spendgate_core::Rate;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

impl Validator<'_, '_> {
    pub(crate) fn server(&mut self, raw: &RawServer) -> R<ServerConfig> {
        let p = KeyPath::of(&["server"]);
        let listen: SocketAddr = raw.listen.trim().parse().map_err(|_| {
            self.err(
                &p.key("listen"),
                format!(
                    "{} is not an address and port such as \"127.0.0.1:8080\" or \"[::]:8080\"",
                    toml_str(&raw.listen)
                ),
            )
        })?;
        let proxies = p.key("trusted_proxies");
        self.list(&proxies, raw.trusted_proxies.len())?;
        let mut trusted_proxies = Vec::new();
        for (i, text) in raw.trusted_proxies.iter().enumerate() {
            let t = text.trim();
            let net = t
                .parse::<ipnet::IpNet>()
                .ok()
                .or_else(|| t.parse::<IpAddr>().ok().map(ipnet::IpNet::from))
                .ok_or_else(|| {
                    self.err(
                        &proxies.idx(i),
                        format!(
                            "{} is not a CIDR such as \"10.0.0.0/8\" or an address",
                            toml_str(text)
                        ),
                    )
                })?;
            // Peers are compared as IPv4 when they are IPv4-mapped IPv6 (SPEC §5), so a
            // mapped CIDR is its IPv4 form: ::ffff:a.b.c.d/N is a.b.c.d/(N-96).
            let net = match net {
                ipnet::IpNet::V6(v6) => match v6.addr().to_ipv4_mapped() {
                    Some(v4) => v6
                        .prefix_len()
                        .checked_sub(96)
                        .and_then(|bits| ipnet::Ipv4Net::new(v4, bits).ok())
                        .map(|n| ipnet::IpNet::V4(n.trunc()))
                        .ok_or_else(|| {
                            self.err(
                                &proxies.idx(i),
                                format!(
                                    "{} is an IPv4-mapped prefix shorter than /96; write its \
                                     IPv4 form (::ffff:a.b.c.d/N is a.b.c.d/(N-96))",
                                    toml_str(text)
                                ),
                            )
                        })?,
                    None => net,
                },
                v4 => v4,
            };
            trusted_proxies.push(net);
        }
        let service_tokens =
            self.secret_list(&p.key("service_tokens"), &raw.service_tokens, "token", 1)?;
        let admin_tokens =
            self.secret_list(&p.key("admin_tokens"), &raw.admin_tokens, "token", 1)?;
        for (i, a) in admin_tokens.iter().enumerate() {
            if service_tokens.iter().any(|s| s.expose() == a.expose()) {
                return Err(self.err(
                    &p.key("admin_tokens").idx(i),
                    "the same token is also a service token; admin tokens must differ",
                ));
            }
        }
        let capacity = self.capacity(&p, raw)?;
        let metrics_listen = match raw.metrics_listen.trim() {
            "" => None,
            text => {
                let key = p.key("metrics_listen");
                let addr: SocketAddr = text.parse().map_err(|_| {
                    self.err(
                        &key,
                        format!(
                            "{} is not \"\" nor an address and port such as \"127.0.0.1:9090\"",
                            toml_str(&raw.metrics_listen)
                        ),
                    )
                })?;
                if addr == listen {
                    return Err(self.err(&key, "is the same address as listen: pick another port"));
                }
                Some(addr)
            }
        };
        Ok(ServerConfig {
            listen,
            metrics_listen,
            trusted_proxies,
            service_tokens,
            admin_tokens,
            browser_direct: raw.browser_direct,
            dry_run: raw.dry_run,
            capacity,
        })
    }

    pub(crate) fn capacity(&mut self, p: &KeyPath, raw: &RawServer) -> R<CapacityConfig> {
        let class = |this: &Self, key: &str, v: u64| -> R<usize> {
            this.int(&p.key(key), v).map(|v| v as usize)
        };
        let connections_max = self.int(&p.key("connections_max"), raw.connections_max)?;
        // (at most half: the other half at least serves everyone)
        let connections_reserved = match raw.connections_reserved {
            None => CONNECTIONS_RESERVED_DEFAULT.min(connections_max / 16),
            Some(n) => {
                let key = p.key("connections_reserved");
                self.range(&key, self.int(&key, n)?, 0, connections_max / 2)?
            }
        };
        Ok(CapacityConfig {
            connections_max: connections_max as usize,
            connections_reserved: connections_reserved as usize,
            public_requests_max: class(self, "public_requests_max", raw.public_requests_max)?,
            service_requests_max: class(self, "service_requests_max", raw.service_requests_max)?,
            admin_requests_max: class(self, "admin_requests_max", raw.admin_requests_max)?,
            health_requests_max: class(self, "health_requests_max", raw.health_requests_max)?,
            address_requests_max: class(self, "address_requests_max", raw.address_requests_max)?,
            address_connections_max: match raw.address_connections_max {
                None => ADDRESS_CONNECTIONS_MAX_DEFAULT.min(connections_max) as usize,
                Some(n) => {
                    let key = p.key("address_connections_max");
                    self.range(&key, self.int(&key, n)?, 1, connections_max)? as usize
                }
            },
            body_min_bytes_per_s: self
                .int(&p.key("body_min_bytes_per_s"), raw.body_min_bytes_per_s)?,
            body_grace: Duration::from_millis(
                self.int(&p.key("body_grace_ms"), raw.body_grace_ms)?,
            ),
        })
    }

    pub(crate) fn store(&mut self, raw: &RawStore) -> R<(StoreConfig, u64)> {
        let p = KeyPath::of(&["store"]);
        let kind = self.one_of(
            &p.key("kind"),
            &raw.kind,
            &[StoreKind::Memory, StoreKind::Sqlite, StoreKind::Redis],
            StoreKind::name,
        )?;
        if kind == StoreKind::Sqlite && raw.path.trim().is_empty() {
            return Err(self.err(&p.key("path"), "the sqlite store needs a file path"));
        }
        let url = self.store_url(&p, kind, &raw.url)?;
        let prefix_ok = !raw.prefix.is_empty()
            && raw.prefix.len() <= 64
            && raw
                .prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b));
        if !prefix_ok {
            return Err(self.err(
                &p.key("prefix"),
                format!(
                    "{} must be 1..=64 characters of letters, digits, _, -, . or : (no braces: \
                     keys carry their own hash tag)",
                    toml_str(&raw.prefix)
                ),
            ));
        }
        let (ledger_id, witness_path) = self.store_pins(&p, raw)?;
        let timeout_ms = self.int(&p.key("timeout_ms"), raw.timeout_ms)?;
        let slow_grace_ms = self.int(&p.key("slow_grace_ms"), raw.slow_grace_ms)?;
        let lease_ttl_s = self.int(&p.key("lease_ttl_s"), raw.lease_ttl_s)?;
        Ok((
            StoreConfig {
                kind,
                path: PathBuf::from(&raw.path),
                url,
                prefix: raw.prefix.clone(),
                ledger_id,
                witness_path,
                timeout: Duration::from_millis(timeout_ms),
                slow_grace: Duration::from_millis(slow_grace_ms),
                lease_ttl: Duration::from_secs(lease_ttl_s),
            },
            lease_ttl_s * 1000,
        ))
    }

    /// `store.url`: a secret; a redis store needs one, of a redis scheme.
    fn store_url(&mut self, p: &KeyPath, kind: StoreKind, url: &str) -> R<Secret> {
        let url_path = p.key("url");
        let url = match self.secret(&url_path, url)? {
            Resolved::Set(s) => s,
            Resolved::Unset(var) => {
                if kind == StoreKind::Redis {
                    return Err(self.err(
                        &url_path,
                        format!(
                            "environment variable {var} is unset but the redis store needs its URL"
                        ),
                    ));
                }
                Secret::from_env(&var, "")
            }
        };
        if kind == StoreKind::Redis {
            let ok = [
                "redis://",
                "rediss://",
                "redis+unix://",
                "unix://",
                "valkey://",
                "valkeys://",
            ]
            .iter()
            .any(|s| url.expose().starts_with(s));
            if !ok {
                return Err(self.err(
                    &url_path,
                    "is not a redis:// or rediss:// URL (value not shown: it may hold a password)",
                ));
            }
        }
        Ok(url)
    }

    /// `store.ledger_id` and `store.witness_path`.
    fn store_pins(&self, p: &KeyPath, raw: &RawStore) -> R<(Option<String>, Option<PathBuf>)> {
        let ledger_id = match raw.ledger_id.trim() {
            "" => None,
            id if spendgate_redis::is_ledger_id(id) => Some(id.to_string()),
            _ => {
                return Err(self.err(
                    &p.key("ledger_id"),
                    format!(
                        "{} is not a ledger id (`lg-` and 32 hex digits): pin the id that \
                         `spendgate store init` printed",
                        toml_str(&raw.ledger_id)
                    ),
                ))
            }
        };
        let witness_path = match raw.witness_path.as_str() {
            "off" => None,
            w if w.trim().is_empty() => {
                return Err(self.err(
                    &p.key("witness_path"),
                    "is empty: name a file on durable storage, or \"off\"",
                ))
            }
            w => Some(PathBuf::from(w)),
        };
        Ok((ledger_id, witness_path))
    }

    #[allow(clippy::type_complexity)]
    pub(crate) fn sessions(
        &mut self,
        raw: &RawSessions,
    ) -> R<(SessionsConfig, Option<Rate>, Option<Rate>)> {
        let p = KeyPath::of(&["sessions"]);
        let keys = self.secret_list(
            &p.key("keys"),
            &raw.keys,
            "session key",
            SESSION_KEY_BYTES_MIN,
        )?;
        let ttl_s = self.int(&p.key("ttl_s"), raw.ttl_s)?;
        let challenge = self.one_of(
            &p.key("challenge"),
            &raw.challenge,
            &[
                ChallengeMode::Off,
                ChallengeMode::Always,
                ChallengeMode::Adaptive,
            ],
            ChallengeMode::name,
        )?;
        let bits = self.int(&p.key("challenge_bits"), raw.challenge_bits)?;
        let challenge_bits =
            u8::try_from(bits).map_err(|_| self.err(&p.key("challenge_bits"), "out of range"))?;
        let per_ip = self.rate(&p.key("create_rate_per_ip"), &raw.create_rate_per_ip)?;
        let global = self.rate(&p.key("create_rate_global"), &raw.create_rate_global)?;
        let verifier_url = match &raw.verifier_url {
            Some(u) => {
                self.http_url(&p.key("verifier_url"), u, false)?;
                Some(u.clone())
            }
            None => None,
        };
        let secret_path = p.key("verifier_secret");
        let verifier_secret = match &raw.verifier_secret {
            Some(text) => Some(match self.secret(&secret_path, text)? {
                Resolved::Set(s) => s,
                Resolved::Unset(var) => Secret::from_env(&var, ""),
            }),
            None => None,
        };
        match (&verifier_url, &verifier_secret) {
            (Some(_), None) => {
                return Err(self.err(&secret_path, "is required when verifier_url is set"));
            }
            (Some(_), Some(s)) if s.expose().is_empty() => {
                return Err(self.err(
                    &secret_path,
                    "is empty (or its environment variable is unset): the verifier would refuse every session",
                ));
            }
            (None, Some(_)) => {
                return Err(self.err(&secret_path, "is set but verifier_url is not"));
            }
            _ => {}
        }
        Ok((
            SessionsConfig {
                keys,
                ttl: Duration::from_secs(ttl_s),
                secure_cookie: raw.secure_cookie,
                challenge,
                challenge_bits,
                verifier_url,
                verifier_secret,
            },
            per_ip,
            global,
        ))
    }

    pub(crate) fn identity(&self, raw: &RawIdentity) -> R<IdentityConfig> {
        let p = KeyPath::of(&["identity"]);
        let v4 = self.int(&p.key("ipv4_prefix"), raw.ipv4_prefix)?;
        let v6 = self.int(&p.key("ipv6_prefix"), raw.ipv6_prefix)?;
        let wider: Vec<u64> = match &raw.ipv6_wider_prefixes {
            None => [56, 48].into_iter().filter(|w| *w < v6).collect(),
            Some(list) => {
                let wp = p.key("ipv6_wider_prefixes");
                self.list(&wp, list.len())?;
                for (i, w) in list.iter().enumerate() {
                    if *w == 0 || *w >= v6 {
                        return Err(self.err(
                            &wp.idx(i),
                            format!("/{w} must be wider than ipv6_prefix /{v6} and at least /1"),
                        ));
                    }
                    if i > 0 && list[i - 1] <= *w {
                        return Err(self.err(
                            &wp.idx(i),
                            "wider prefixes must be listed narrowest first (e.g. [56, 48])",
                        ));
                    }
                }
                list.clone()
            }
        };
        let mut ipv6_wider = Vec::new();
        let mut factor: u64 = 1;
        for w in wider {
            factor = factor.saturating_mul(4);
            // In range by the checks above.
            let w = u8::try_from(w).unwrap_or(u8::MAX);
            ipv6_wider.push((w, factor));
        }
        Ok(IdentityConfig {
            ipv4_prefix: u8::try_from(v4).unwrap_or(32),
            ipv6_prefix: u8::try_from(v6).unwrap_or(128),
            ipv6_wider,
        })
    }
}
