//! The CO's mount flags (`VolumeCapability.mount.mount_flags`: a PV's `mountOptions`, and the
//! SELinux `context=` kubelet adds when the CSIDriver says `seLinuxMount: true`), split into
//! single options the way the kernel splits them, checked, and the SELinux context among them.
//!
//! Splitting: a comma separates options except inside double quotes, because a context with MCS
//! categories has commas of its own and kubelet quotes it (`context="system_u:object_r:
//! container_file_t:s0:c3,c7"`); the kernel's SELinux option parser takes the quotes off. An
//! unbalanced quote, or a NUL, newline or space anywhere, is refused: such an option could only
//! be a mistake or an attempt to smuggle another one past a check.
//!
//! What each kind of volume does with the context: a filesystem the node mounts itself (a
//! replicated or RBD volume, an NFS share) gets it as a mount option, so every file shows that
//! label with nothing written to the volume; a directory volume is bind-mounted and a bind
//! mount takes no context, so its tree is relabelled instead (what the container runtime's
//! recursive relabel would have done had the CSIDriver not declared `seLinuxMount`).

use std::path::Path;

use crate::error::{CsiError, CsiResult};

/// The mount options that set SELinux labels (mount(8)'s "SELinux options").
const CONTEXT_OPTIONS: &[&str] = &["context", "fscontext", "defcontext", "rootcontext"];

/// Every single option of `flags` (each flag may hold several, comma-separated), in order,
/// quotes kept (the kernel wants them). INVALID_ARGUMENT names a malformed one.
pub fn split(flags: &[String]) -> CsiResult<Vec<String>> {
    let mut out = Vec::new();
    for flag in flags {
        if flag.contains(['\0', '\n', ' ', '\t']) {
            return Err(CsiError::Invalid(format!("mount flag {flag:?} is not allowed (whitespace or NUL)")));
        }
        let mut quoted = false;
        let mut current = String::new();
        for c in flag.chars() {
            match c {
                '"' => {
                    quoted = !quoted;
                    current.push(c);
                }
                ',' if !quoted => out.extend(take(&mut current)),
                _ => current.push(c),
            }
        }
        if quoted {
            return Err(CsiError::Invalid(format!("mount flag {flag:?} has an unbalanced double quote")));
        }
        out.extend(take(&mut current));
    }
    for opt in &out {
        // A quote belongs only around an SELinux context's value, where the kernel expects it.
        let (name, value) = opt.split_once('=').unwrap_or((opt, ""));
        if opt.contains('"') && !(CONTEXT_OPTIONS.contains(&name) && is_quoted(value)) {
            return Err(CsiError::Invalid(format!(
                "mount flag {opt:?}: double quotes are allowed only around an SELinux context"
            )));
        }
    }
    Ok(out)
}

/// [`split`], for a mount the node makes with them: an option that means something only to
/// mount(8) or to other layers (`bind`, `rbind`, `remount`, `loop`) could only turn it into
/// another kind of mount, and is INVALID_ARGUMENT.
pub fn for_mount(flags: &[String]) -> CsiResult<Vec<String>> {
    let options = split(flags)?;
    if let Some(bad) = options.iter().find(|o| matches!(o.as_str(), "bind" | "rbind" | "remount" | "loop")) {
        return Err(CsiError::Invalid(format!("mount flag {bad:?} is not allowed")));
    }
    Ok(options)
}

fn take(current: &mut String) -> Option<String> {
    let opt = std::mem::take(current);
    let opt = opt.trim();
    (!opt.is_empty()).then(|| opt.to_owned())
}

fn is_quoted(value: &str) -> bool {
    value.len() >= 2 && value.starts_with('"') && value.ends_with('"') && !value[1..value.len() - 1].contains('"')
}

/// Whether `opt` (one option of [`split`]) sets an SELinux label.
pub fn is_selinux(opt: &str) -> bool {
    CONTEXT_OPTIONS.contains(&opt.split_once('=').map_or(opt, |(name, _)| name))
}

/// The label of the `context=` option among `flags`, quotes removed; `None` without one.
/// Two different ones are INVALID_ARGUMENT.
pub fn selinux_context(flags: &[String]) -> CsiResult<Option<String>> {
    let mut found: Option<String> = None;
    for opt in split(flags)? {
        let Some(value) = opt.strip_prefix("context=") else { continue };
        let label = value.trim_matches('"').to_owned();
        if label.is_empty() {
            return Err(CsiError::Invalid("mount flag context= has no label".into()));
        }
        match &found {
            Some(other) if *other != label => {
                return Err(CsiError::Invalid(format!("two SELinux contexts in the mount flags: {other} and {label}")));
            }
            _ => found = Some(label),
        }
    }
    Ok(found)
}

/// Labels `dir` and everything under it (not following symlinks, not crossing into other
/// mounts) with `label`, as a recursive relabel would; a tree already labelled so at its root
/// is left as it is (a retried stage costs one getxattr). The root is labelled last, so a
/// relabel cut short is done again whole. ENOTSUP (a filesystem without
/// labels, a kernel without SELinux) is FAILED_PRECONDITION: the pod would be denied access.
pub fn relabel_tree(dir: &Path, label: &str) -> CsiResult<()> {
    const XATTR: &str = "security.selinux";
    let fail = |path: &Path, e: std::io::Error| {
        let what = format!("labelling {} with SELinux context {label}", path.display());
        match e.raw_os_error() {
            Some(code) if code == nix::errno::Errno::ENOTSUP as i32 => CsiError::FailedPrecondition(format!(
                "{what}: the filesystem or this kernel does not support SELinux labels ({e})"
            )),
            _ => CsiError::Internal(format!("{what}: {e}")),
        }
    };
    let current = xattr::get(dir, XATTR).map_err(|e| fail(dir, e))?;
    if current.as_deref().map(|v| v.strip_suffix(b"\0").unwrap_or(v)) == Some(label.as_bytes()) {
        return Ok(());
    }
    for entry in walkdir::WalkDir::new(dir).same_file_system(true).follow_links(false).contents_first(true) {
        let entry = entry.map_err(|e| CsiError::Internal(format!("walking {}: {e}", dir.display())))?;
        xattr::set(entry.path(), XATTR, label.as_bytes()).map_err(|e| fail(entry.path(), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_quoted_context_keeps_its_commas_and_quotes() {
        let flags = strings(&["noatime,context=\"system_u:object_r:container_file_t:s0:c3,c7\"", "nodev"]);
        assert_eq!(
            split(&flags).expect("split"),
            strings(&["noatime", "context=\"system_u:object_r:container_file_t:s0:c3,c7\"", "nodev"])
        );
        assert_eq!(
            selinux_context(&flags).expect("context").as_deref(),
            Some("system_u:object_r:container_file_t:s0:c3,c7")
        );
        assert!(is_selinux("context=\"a:b:c:s0\"") && is_selinux("rootcontext=x") && !is_selinux("noatime"));
    }

    #[test]
    fn malformed_flags_are_refused_naming_them() {
        for bad in ["context=\"a:b:c:s0:c1,c2", "a b", "x\"y\"", "nfsvers=\"4\"", "context=\"a\"b\""] {
            let e = split(&strings(&[bad])).expect_err(bad);
            assert!(matches!(&e, CsiError::Invalid(m) if m.contains(&format!("{bad:?}"))), "{bad}: {e:?}");
        }
        assert_eq!(split(&strings(&["noatime,remount"])).expect("split").len(), 2);
        let e = for_mount(&strings(&["noatime,remount"])).expect_err("remount");
        assert!(matches!(&e, CsiError::Invalid(m) if m.contains("\"remount\"")), "{e:?}");
        let two = strings(&["context=\"u:r:t:s0:c1\"", "context=u:r:t:s0:c2"]);
        assert!(matches!(selinux_context(&two), Err(CsiError::Invalid(_))));
        assert_eq!(selinux_context(&strings(&["ro", "noatime"])).expect("none"), None);
        assert!(split(&strings(&["", ",,"])).expect("empty").is_empty());
    }
}
