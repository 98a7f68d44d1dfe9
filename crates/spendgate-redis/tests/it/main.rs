//! Integration tests of the redis store, each against a private `redis-server` started by
//! `spendgate_testkit::RedisServer` (never the shared one on 6379).

mod cluster;
mod conformance;
mod differential;
mod faults;
mod grace;
mod identity;
mod keys;
mod support;
mod worst_case;
