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
        assert!(check_metadata("k", "").is_ok());
        assert!(check_metadata("", "v").is_err());
        assert!(check_metadata("k", "a\0").is_err());
    }
}
