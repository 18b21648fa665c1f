//! Credentials for the unit tests: a fresh CA and sets issued by it, in temporary directories.

use crate::credentials::Credentials;
use crate::identity::Role;
use crate::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};

pub(crate) struct Pki {
    pub(crate) ca: Authority,
    dirs: Vec<tempfile::TempDir>,
}

impl Pki {
    pub(crate) fn new() -> Pki {
        Pki { ca: Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).expect("CA"), dirs: Vec::new() }
    }

    /// Loaded credentials for `role`.
    pub(crate) fn credentials(&mut self, role: &Role) -> Credentials {
        let dir = tempfile::tempdir().expect("tempdir");
        self.ca
            .issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))
            .expect("issue")
            .write(dir.path(), &[self.ca.certificate().clone()])
            .expect("write");
        let credentials = Credentials::load(dir.path()).expect("load");
        self.dirs.push(dir);
        credentials
    }
}
