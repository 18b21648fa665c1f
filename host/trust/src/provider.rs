//! The one rustls crypto provider of the product: *ring*, TLS 1.3 only, AES-128-GCM first.
//!
//! AES-128-GCM is the cheapest AEAD on the data path with AES-NI (fewer rounds than AES-256, and
//! ChaCha20 only wins without AES instructions), so servers choose it (`ignore_client_order`)
//! whenever the client offers it. The others stay for peers that prefer them. Key exchange:
//! X25519, then P-256. No TLS 1.2, no session resumption, no early data: every connection is a
//! full mutually authenticated handshake, and nothing arrives before it completes.

use std::sync::{Arc, OnceLock};

use rustls::SupportedProtocolVersion;
use rustls::crypto::CryptoProvider;
use rustls::crypto::ring::{self, cipher_suite, kx_group};

/// The protocol versions every config allows: TLS 1.3 alone.
pub static PROTOCOL_VERSIONS: &[&SupportedProtocolVersion] = &[&rustls::version::TLS13];

/// The provider, built once.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            Arc::new(CryptoProvider {
                cipher_suites: vec![
                    cipher_suite::TLS13_AES_128_GCM_SHA256,
                    cipher_suite::TLS13_AES_256_GCM_SHA384,
                    cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
                ],
                kx_groups: vec![kx_group::X25519, kx_group::SECP256R1],
                ..ring::default_provider()
            })
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aes_128_gcm_comes_first_and_nothing_is_tls12() {
        let p = provider();
        assert_eq!(p.cipher_suites[0].suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert!(p.cipher_suites.iter().all(|s| s.version() == &rustls::version::TLS13));
    }
}
