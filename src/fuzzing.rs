//! Entry points for the fuzz targets in `fuzz/`: what they need that the public API does not
//! already offer. Hidden from the docs; not a supported interface.

use crate::config::{Config, ConfigError, Lookup};
use crate::store::{Completion, Digest, RecordKey};

/// Parses and validates a config exactly like [`Config::from_yaml_str`], except that upstream
/// addresses are checked by their `host:port` shape only: a fuzzer must not send a DNS query for
/// every random host name it makes up.
pub fn config_from_yaml(text: &str) -> Result<Config, ConfigError> {
    Config::from_yaml_str_with(text, Lookup::Offline)
}

/// What `idemgate --reconcile` reads from one dead-letter line: the record, its execution id, the
/// request's fingerprint (when the line has one), the response and when its `ttl` ends.
pub type DeadLetter = (RecordKey, u64, Option<Digest>, Completion, u64);

/// Reads one dead-letter line exactly as `--reconcile` does.
pub fn dead_letter(line: &str) -> Result<DeadLetter, String> {
    crate::reconcile::parse_for_fuzzing(line)
}
