//! Entry points for the fuzz targets in `fuzz/`: what they need that the public API does not
//! already offer. Hidden from the docs; not a supported interface.

use crate::config::{Config, ConfigError, Lookup};

/// Parses and validates a config exactly like [`Config::from_yaml_str`], except that upstream
/// addresses are checked by their `host:port` shape only: a fuzzer must not send a DNS query for
/// every random host name it makes up.
pub fn config_from_yaml(text: &str) -> Result<Config, ConfigError> {
    Config::from_yaml_str_with(text, Lookup::Offline)
}
