//! Checks of the names a guest passes, before they reach librbd (which would accept some of
//! them and build object names from them) or a monitor command.

use crate::RbdError;

/// librbd's own limit on image names is larger; CSI names fit well within this.
pub const MAX_NAME: usize = 200;

/// A pool, image or snapshot name: non-empty, at most [`MAX_NAME`] bytes, no `/` or `@` (they
/// separate pool, image and snapshot in `pool/image@snap`), no NUL or other control character,
/// not `.`/`..`.
pub fn check(kind: &str, name: &str) -> Result<(), RbdError> {
    let bad = |why: &str| Err(RbdError::InvalidArgument(format!("{kind} name {name:?} {why}")));
    if name.is_empty() {
        return bad("is empty");
    }
    if name.len() > MAX_NAME {
        return bad(&format!("is longer than {MAX_NAME} bytes"));
    }
    if name == "." || name == ".." {
        return bad("is reserved");
    }
    if let Some(c) = name.chars().find(|c| *c == '/' || *c == '@' || c.is_control()) {
        return bad(&format!("contains {c:?}"));
    }
    Ok(())
}

/// A snapshot as a guest names it: an ordinary snapshot by its name, or an image's part of the
/// RBD group snapshot `SNAP` of the group `GROUP` (in the pool of the call) as `GROUP@SNAP`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapRef<'a> {
    User(&'a str),
    Group { group: &'a str, snap: &'a str },
}

impl<'a> SnapRef<'a> {
    /// Parsed and checked (each part as [`check`] wants it).
    pub fn parse(name: &'a str) -> Result<Self, RbdError> {
        match name.split_once('@') {
            Some((group, snap)) => {
                check("group", group)?;
                check("group snapshot", snap)?;
                Ok(Self::Group { group, snap })
            }
            None => {
                check("snapshot", name)?;
                Ok(Self::User(name))
            }
        }
    }
}

/// A metadata key: non-empty, no NUL/control characters, bounded; values only must not
/// contain NUL (librbd takes C strings).
pub fn check_metadata(key: &str, value: &str) -> Result<(), RbdError> {
    if key.is_empty() || key.len() > MAX_NAME || key.chars().any(char::is_control) {
        return Err(RbdError::InvalidArgument(format!(
            "metadata key {key:?} is empty, too long or has control characters"
        )));
    }
    if value.contains('\0') {
        return Err(RbdError::InvalidArgument(format!("metadata value of {key:?} contains NUL")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for ok in ["pvc-1", "a.b_c-D", "x"] {
            assert!(check("image", ok).is_ok(), "{ok}");
        }
        let long = "x".repeat(MAX_NAME + 1);
        for bad in ["", "a/b", "a@b", "a\0b", "a\nb", ".", "..", long.as_str()] {
            assert!(matches!(check("image", bad), Err(RbdError::InvalidArgument(_))), "{bad:?}");
        }
        assert_eq!(SnapRef::parse("s").expect("user"), SnapRef::User("s"));
        assert_eq!(SnapRef::parse("g@s").expect("group"), SnapRef::Group { group: "g", snap: "s" });
        for bad in ["g@", "@s", "g@s@t", "a/b@s", ""] {
            assert!(SnapRef::parse(bad).is_err(), "{bad:?}");
        }
        assert!(check_metadata("k", "").is_ok());
        assert!(check_metadata("", "v").is_err());
        assert!(check_metadata("k", "a\0").is_err());
    }
}
