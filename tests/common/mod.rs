//! Test harness: a real counting backend, the real `idemgate` binary, and a raw HTTP/1.1 client.
#![allow(dead_code, unused_imports)]

pub mod backend;
pub mod client;
pub mod faultproxy;
pub mod proxy;
pub mod rawbackend;
pub mod redis;
pub mod soak_backend;
pub mod tls;

pub use backend::Backend;
pub use client::{Request, Response};
pub use proxy::{Proxy, ProxyBuilder};
