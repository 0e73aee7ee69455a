//! idemgate: a reverse proxy that makes non-idempotent HTTP APIs safe to retry.
//!
//! Architecture map (dependencies point one way, left to right):
//!
//! ```text
//!   config / scripts  ──►  key / snowflake / store  ──►  proxy / admin  ──►  server (main)
//! ```
//!
//! - [`config`]: YAML file structs and the validated, immutable [`config::Config`].
//! - [`key`]: idempotency-key and tenant parsing, record ids and request fingerprints.
//! - [`snowflake`]: time-ordered 64-bit execution ids; [`worker_lease`]: their worker ids
//!   leased from Redis.
//! - [`scripts`]: Lua script sources of the Redis store: built-in versions and a directory.
//! - [`store`]: the [`store::RecordStore`] seam and its backends.
//! - [`problem`]: every error the proxy itself answers, as RFC 9457 problem+json.
//! - [`metrics`]: the Prometheus registry shared by proxy and admin.
//! - [`proxy`]: the pingora `ProxyHttp` implementation: the request flow.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`, `/admin/...`.
//! - [`reload`]: live config reload; [`script_reload`]: live Lua script versions.
//! - [`headguard`]: limits on request headers (deadline, size), problem+json for the ones
//!   pingora refuses itself, and a deadline on writes that wait for the client.
//! - [`budget`]: the memory all keyed requests' bodies may hold at once.
//! - [`server`]: wires pingora services, logging and graceful shutdown.
//! - [`throttle`]: warnings that would otherwise come once per request during an outage.

pub mod accesslog;
pub mod admin;
pub mod budget;
pub mod config;
#[doc(hidden)]
pub mod fuzzing;
pub mod headguard;
pub mod key;
pub mod logwriter;
pub mod metrics;
pub mod problem;
pub mod proxy;
pub mod reconcile;
pub mod reload;
pub mod script_reload;
pub mod scripts;
pub mod server;
pub mod snowflake;
pub mod store;
pub mod throttle;
pub mod upstream;
pub mod worker_lease;
