//! The `nfs` capability's client against a real nfs-ganesha over NFSv3, each test with its own
//! server in its own namespaces (`wasmcsi_ganesha::Ganesha`). Needs root and
//! `scripts/nfs-setup`. Results are checked on the server's exported directory directly.
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};
use wasmcsi_ganesha::Ganesha;
use wasmcsi_nfs::{FileKind, NfsClient, NfsError, NfsExport};

/// What a loaded 2-core machine may add to the moment a timeout fires and its caller runs. The
/// timing asserts below only have to tell a timeout that fires from one that does not (a
/// frozen server or a lost SYN would otherwise hold a call for minutes).
const SLACK: Duration = Duration::from_secs(1);

fn setup() -> (Ganesha, NfsClient, NfsExport) {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    let g = Ganesha::start().expect("start ganesha (root and scripts/nfs-setup needed)");
    let client = NfsClient::new(g.config());
    let export = g.export();
    (g, client, export)
}

#[tokio::test]
async fn mkdir_stat_read_dir_and_their_errors() {
    let (g, c, e) = setup();
    c.mkdir(&e, "vols/a", 0o750, 1000, 2000).await.expect("mkdir with parents");
    let m = fs::metadata(g.export_dir().join("vols/a")).expect("on server");
    assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o750, 1000, 2000));
    c.mkdir(&e, "vols/a", 0o700, 0, 0).await.expect("existing directory is success");
    assert_eq!(fs::metadata(g.export_dir().join("vols/a")).expect("dir").mode() & 0o7777, 0o750);

    fs::write(g.export_dir().join("vols/f"), b"x").expect("server-side file");
    assert!(matches!(c.mkdir(&e, "vols/f", 0o755, 0, 0).await, Err(NfsError::AlreadyExists(_))));
    assert!(matches!(c.mkdir(&e, "vols/f/sub", 0o755, 0, 0).await, Err(NfsError::InvalidArgument(_))));

    let st = c.stat(&e, "vols/a").await.expect("stat").expect("present");
    assert_eq!((st.kind, st.mode, st.uid, st.gid), (FileKind::Directory, 0o750, 1000, 2000));
    let st = c.stat(&e, "vols/f").await.expect("stat").expect("present");
    assert_eq!((st.kind, st.size), (FileKind::File, 1));
    assert_eq!(c.stat(&e, "vols/missing").await.expect("stat"), None);
    assert_eq!(c.stat(&e, "missing/deeper").await.expect("stat"), None);
    assert!(c.stat(&e, "").await.expect("root").is_some());

    assert_eq!(c.read_dir(&e, "vols").await.expect("ls"), ["a", "f"]);
    assert!(matches!(c.read_dir(&e, "nope").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.read_dir(&e, "vols/f").await, Err(NfsError::InvalidArgument(_))));
}

#[tokio::test]
async fn write_file_is_atomic_and_read_file_bounds() {
    let (g, c, e) = setup();
    c.mkdir(&e, "v", 0o755, 0, 0).await.expect("mkdir");
    c.write_file(&e, "v/meta.json", b"one").await.expect("write");
    c.write_file(&e, "v/meta.json", b"two!").await.expect("overwrite");
    assert_eq!(fs::read(g.export_dir().join("v/meta.json")).expect("server"), b"two!");
    assert_eq!(c.read_file(&e, "v/meta.json").await.expect("read"), b"two!");
    // No temporary left behind.
    assert_eq!(c.read_dir(&e, "v").await.expect("ls"), ["meta.json"]);
    // Bigger than one WRITE/READ: several chunks.
    let big: Vec<u8> = (0..(3 << 20) / 4 * 3).map(|i| (i % 251) as u8).collect();
    let big = &big[..(1 << 20) - 7];
    c.write_file(&e, "v/big", big).await.expect("write big");
    assert_eq!(c.read_file(&e, "v/big").await.expect("read big"), big);
    fs::write(g.export_dir().join("v/huge"), vec![1u8; (1 << 20) + 1]).expect("server-side");
    assert!(matches!(c.read_file(&e, "v/huge").await, Err(NfsError::InvalidArgument(_))));
    assert!(matches!(c.read_file(&e, "v").await, Err(NfsError::InvalidArgument(_))));
    assert!(matches!(c.read_file(&e, "v/none").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.write_file(&e, "nodir/x", b"1").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.write_file(&e, "v", b"1").await, Err(NfsError::InvalidArgument(_))));
}

#[tokio::test]
async fn rename_remove_all_usage_and_fs_stats() {
    let (g, c, e) = setup();
    c.mkdir(&e, "a/b/c", 0o755, 0, 0).await.expect("mkdir");
    c.write_file(&e, "a/b/c/f", &[7u8; 5000]).await.expect("write");
    c.write_file(&e, "a/g", &[7u8; 100]).await.expect("write");
    assert_eq!(c.usage(&e, "a").await.expect("usage"), 5100);
    assert_eq!(c.usage(&e, "a/g").await.expect("usage of a file"), 100);
    assert!(matches!(c.usage(&e, "zz").await, Err(NfsError::NotFound(_))));

    c.rename(&e, "a/b", "moved").await.expect("rename");
    assert!(g.export_dir().join("moved/c/f").exists());
    assert!(matches!(c.rename(&e, "a/b", "x").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.rename(&e, "a/g", "moved").await, Err(NfsError::AlreadyExists(_))));
    assert!(matches!(c.rename(&e, "a/g", "none/x").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.rename(&e, "moved", "moved/c/in").await, Err(NfsError::InvalidArgument(_))));

    c.remove_all(&e, "moved").await.expect("remove tree");
    assert!(!g.export_dir().join("moved").exists());
    c.remove_all(&e, "moved").await.expect("absent succeeds");
    c.remove_all(&e, "nodir/deeper").await.expect("absent parent succeeds");
    c.remove_all(&e, "a/g").await.expect("remove file");
    assert!(matches!(c.remove_all(&e, "").await, Err(NfsError::InvalidArgument(_))));

    let s = c.fs_stats(&e).await.expect("fsstat");
    assert!(s.total_bytes > 0 && s.available_bytes <= s.total_bytes, "{s:?}");
}

#[tokio::test]
async fn bad_paths_symlinks_and_ungranted_exports_are_refused() {
    let (g, c, e) = setup();
    for bad in ["/abs", "a/../b", "..", "a\0b", "a//b", "./a"] {
        assert!(matches!(c.stat(&e, bad).await, Err(NfsError::InvalidArgument(_))), "{bad:?}");
        assert!(matches!(c.mkdir(&e, bad, 0o755, 0, 0).await, Err(NfsError::InvalidArgument(_))), "{bad:?}");
        assert!(matches!(c.remove_all(&e, bad).await, Err(NfsError::InvalidArgument(_))), "{bad:?}");
    }
    let long = "x".repeat(256);
    assert!(matches!(c.write_file(&e, &long, b"1").await, Err(NfsError::InvalidArgument(_))));

    // A symlink on the server pointing out of the export is never followed.
    std::os::unix::fs::symlink("/etc", g.export_dir().join("link")).expect("symlink");
    assert!(matches!(c.read_file(&e, "link/passwd").await, Err(NfsError::PermissionDenied(_))));
    assert!(matches!(c.stat(&e, "link").await, Err(NfsError::PermissionDenied(_))));
    assert!(matches!(c.write_file(&e, "link", b"x").await, Err(NfsError::PermissionDenied(_))));
    assert!(matches!(c.mkdir(&e, "link/x", 0o755, 0, 0).await, Err(NfsError::PermissionDenied(_))));
    assert!(matches!(c.remove_all(&e, "link").await, Err(NfsError::PermissionDenied(_))));
    assert!(Path::new("/etc/passwd").exists());

    // Ungranted: refused before any traffic. A server that does not exist proves it: a call
    // that tried to reach it would wait out the connect timeout before failing.
    let other = NfsExport::new("192.0.2.123", "/export");
    let t = Instant::now();
    assert!(matches!(c.mkdir(&other, "x", 0o755, 0, 0).await, Err(NfsError::PermissionDenied(_))));
    let same_server_other_share = NfsExport::new(g.server(), "/other");
    assert!(matches!(c.stat(&same_server_other_share, "").await, Err(NfsError::PermissionDenied(_))));
    assert!(t.elapsed() < c.config().connect_timeout, "{:?}", t.elapsed());
    // A trailing slash names the same export.
    c.stat(&NfsExport::new(g.server(), "/export/"), "").await.expect("normalized share");
}

fn set_times(p: &Path, secs: i64, nanos: i64) {
    let ts = format!("@{secs}.{nanos:09}");
    let out = std::process::Command::new("touch").args(["-h", "-d", &ts]).arg(p).output().expect("touch");
    assert!(out.status.success(), "touch {p:?}: {out:?}");
}

#[tokio::test]
async fn copy_tree_preserves_content_modes_owners_times_and_symlinks() {
    let (g, c, e) = setup();
    let root = g.export_dir();
    let src = root.join("src");
    fs::create_dir_all(src.join("private/deep")).expect("dirs");
    fs::create_dir_all(src.join("shared")).expect("dirs");
    fs::write(src.join("private/secret"), b"s3cret").expect("file");
    fs::write(src.join("private/deep/big"), (0..3_000_000u32).map(|i| (i % 253) as u8).collect::<Vec<u8>>())
        .expect("big");
    fs::write(src.join("shared/readme"), b"hello").expect("file");
    fs::write(src.join("empty"), b"").expect("empty");
    // A sparse file: a hole then data, then a trailing hole.
    let sparse = fs::File::create(src.join("sparse")).expect("sparse");
    sparse.set_len(5 << 20).expect("len");
    std::os::unix::fs::FileExt::write_at(&sparse, b"tail", 2 << 20).expect("write");
    drop(sparse);
    std::os::unix::fs::symlink("shared/readme", src.join("link")).expect("symlink");
    let perms = [("private", 0o700), ("private/secret", 0o600), ("shared", 0o2775), ("shared/readme", 0o644)];
    for (p, mode) in perms {
        fs::set_permissions(src.join(p), fs::Permissions::from_mode(mode)).expect("chmod");
    }
    for (p, uid, gid) in [("private", 1001, 1001), ("private/secret", 1001, 1001), ("shared", 1002, 50)] {
        std::os::unix::fs::lchown(src.join(p), Some(uid), Some(gid)).expect("chown");
    }
    std::os::unix::fs::lchown(src.join("link"), Some(1002), Some(1002)).expect("lchown");
    let mut t = 1_600_000_000;
    for p in [
        "private/deep/big",
        "private/deep",
        "private/secret",
        "private",
        "shared/readme",
        "shared",
        "link",
        "empty",
        "sparse",
        "",
    ] {
        set_times(&src.join(p), t, 123_456_789);
        t += 1000;
    }

    c.copy_tree(&e, "src", "snap").await.expect("copy-tree");

    let dst = root.join("snap");
    let mut checked = 0;
    let mut stack = vec![std::path::PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let (a, b) =
            (fs::symlink_metadata(src.join(&rel)).expect("src"), fs::symlink_metadata(dst.join(&rel)).expect("dst"));
        let what = format!("{rel:?}");
        assert_eq!(a.file_type(), b.file_type(), "{what}");
        assert_eq!((a.uid(), a.gid()), (b.uid(), b.gid()), "{what} owner");
        if a.file_type().is_symlink() {
            // ganesha 4.3's VFS FSAL accepts SETATTR (and SYMLINK attributes) with times on a
            // symlink and ignores them: the client sends them; this server cannot keep them.
            assert_eq!(fs::read_link(src.join(&rel)).expect("l"), fs::read_link(dst.join(&rel)).expect("l"));
        } else {
            assert_eq!((a.mtime(), a.mtime_nsec()), (b.mtime(), b.mtime_nsec()), "{what} mtime");
            assert_eq!(a.mode(), b.mode(), "{what} mode");
        }
        if a.is_file() {
            assert_eq!(fs::read(src.join(&rel)).expect("a"), fs::read(dst.join(&rel)).expect("b"), "{what} content");
        }
        if a.is_dir() {
            let mut names: Vec<_> =
                fs::read_dir(src.join(&rel)).expect("ls").map(|d| d.expect("entry").file_name()).collect();
            let mut copied: Vec<_> =
                fs::read_dir(dst.join(&rel)).expect("ls").map(|d| d.expect("entry").file_name()).collect();
            names.sort();
            copied.sort();
            assert_eq!(names, copied, "{what} entries");
            stack.extend(names.into_iter().map(|n| rel.join(n)));
        }
        checked += 1;
    }
    assert_eq!(checked, 10);
    let sparse = fs::metadata(dst.join("sparse")).expect("sparse");
    // Only the one chunk holding data is written (1 MiB of the 5 MiB).
    assert!(sparse.blocks() * 512 <= 1 << 20, "sparse file stays sparse: {} blocks", sparse.blocks());
    // No temporary left beside the target.
    let mut top: Vec<_> = fs::read_dir(&root).expect("ls").map(|d| d.expect("e").file_name()).collect();
    top.sort();
    assert_eq!(top, ["snap", "src"]);

    assert!(matches!(c.copy_tree(&e, "src", "snap").await, Err(NfsError::AlreadyExists(_))));
    assert!(matches!(c.copy_tree(&e, "nope", "x").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.copy_tree(&e, "src", "nodir/x").await, Err(NfsError::NotFound(_))));
    assert!(matches!(c.copy_tree(&e, "src", "src/inner").await, Err(NfsError::InvalidArgument(_))));
    // A single file copies too.
    c.copy_tree(&e, "src/shared/readme", "readme-copy").await.expect("file copy");
    assert_eq!(fs::metadata(root.join("readme-copy")).expect("copy").mode() & 0o7777, 0o644);
}

#[tokio::test]
async fn frozen_or_stopped_server_is_unavailable_within_the_timeout_and_the_client_recovers() {
    let (g, c, e) = setup();
    c.mkdir(&e, "d", 0o755, 0, 0).await.expect("mkdir");
    let limit = c.config().op_timeout.max(c.config().connect_timeout);

    // Frozen: TCP is accepted by the kernel, nothing answers.
    g.pause().expect("pause");
    let t = Instant::now();
    match c.stat(&e, "d").await {
        Err(NfsError::Unavailable { server, reason }) => {
            assert_eq!(server, g.server());
            assert!(reason.contains(&g.server()), "{reason}");
        }
        other => {
            let ps = std::process::Command::new("ps").args(["-eo", "pid,stat,args"]).output().expect("ps");
            let ps = String::from_utf8_lossy(&ps.stdout)
                .lines()
                .filter(|l| l.contains("ganesha.nfsd"))
                .map(|l| l.chars().take(120).collect::<String>())
                .collect::<Vec<_>>()
                .join("\n");
            panic!(
                "expected Unavailable, got {other:?} after {:?}; server {}; {}\n{ps}",
                t.elapsed(),
                g.server(),
                g.export_dir().display()
            )
        }
    }
    assert!(t.elapsed() < limit + SLACK, "took {:?}", t.elapsed());
    g.resume().expect("resume");
    assert!(c.stat(&e, "d").await.expect("after resume").is_some());

    // Stopped: connections refused, then ganesha restarts on new MOUNT ports.
    g.stop_server().expect("stop");
    let t = Instant::now();
    assert!(matches!(c.write_file(&e, "d/f", b"x").await, Err(NfsError::Unavailable { .. })));
    assert!(t.elapsed() < limit + SLACK, "took {:?}", t.elapsed());
    g.start_server().expect("start again");
    c.write_file(&e, "d/f", b"back").await.expect("recovered");
    assert_eq!(fs::read(g.export_dir().join("d/f")).expect("server"), b"back");
}

#[tokio::test]
async fn unreachable_server_is_unavailable_within_the_connect_timeout() {
    let (g, _, _) = setup();
    // Our end of the link down: the server's /30 is gone from the routing table and SYNs leave
    // by the default route into nowhere. The client must still answer in time.
    let mut cfg = g.config();
    cfg.connect_timeout = Duration::from_secs(1);
    let c = NfsClient::new(cfg);
    let link = |state: &str| {
        let out = std::process::Command::new("ip").args(["link", "set", g.host_interface(), state]).output();
        assert!(out.expect("ip").status.success());
    };
    link("down");
    let t = Instant::now();
    let r = c.fs_stats(&g.export()).await;
    assert!(matches!(r, Err(NfsError::Unavailable { .. })), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(1) + SLACK, "took {:?}", t.elapsed());
    link("up");
    // The client recovers once the server is reachable again; how many attempts that takes is
    // the network's business (the first SYN after the link comes up, or a loaded server's
    // MOUNT, may miss the 1 s connect timeout), so retry, each attempt bounded by that timeout.
    let back = Instant::now();
    while let Err(e) = c.fs_stats(&g.export()).await {
        assert!(back.elapsed() < Duration::from_secs(30), "no fsstat 30 s after the link is back: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_tasks_share_one_pooled_client() {
    let (g, c, e) = setup();
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (c, e) = (c.clone(), e.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                let dir = format!("t{t}/d{i}");
                c.mkdir(&e, &dir, 0o755, 0, 0).await?;
                c.write_file(&e, &format!("{dir}/f"), format!("{t}-{i}").as_bytes()).await?;
                assert_eq!(c.read_file(&e, &format!("{dir}/f")).await?, format!("{t}-{i}").as_bytes());
                if i % 2 == 0 {
                    c.remove_all(&e, &dir).await?;
                }
            }
            Ok::<(), NfsError>(())
        }));
    }
    for t in tasks {
        t.await.expect("join").expect("task");
    }
    for t in 0..8 {
        let names = fs::read_dir(g.export_dir().join(format!("t{t}"))).expect("ls").count();
        assert_eq!(names, 5);
    }
}

/// A copy longer than a call: the first call starts it, later calls report progress and then
/// done; a copy from another source to the same target is refused while it runs; a failed copy
/// reports its error once; a cancelled copy stops and leaves only its temporary in the parent;
/// a stale temporary of a dead process is removed when the copy starts again. Copies are held
/// before they are placed (`hold_copies`) where the test needs one still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_copy_reports_progress_until_done_and_can_be_cancelled() {
    let (g, c, e) = setup();
    let root = g.export_dir();
    fs::create_dir_all(root.join("vol/d")).expect("dirs");
    let data: Vec<u8> = (0..32u32 << 20).map(|i| (i % 251) as u8 | 1).collect();
    fs::write(root.join("vol/d/big"), &data).expect("big");
    fs::create_dir_all(root.join("snap")).expect("parent");
    // what a process that died mid-copy left behind
    fs::create_dir_all(root.join("snap/.wasmcsi-copy-999999999-0-0/junk")).expect("stale");

    let hold = wasmcsi_nfs::hold_copies(&e);
    let first = c.copy_tree_background(&e, "vol", "snap/data", Duration::from_millis(200)).await.expect("start");
    assert!(!first.done, "a held copy is not placed");
    let other = c.copy_tree_background(&e, "elsewhere", "snap/data", Duration::ZERO).await;
    assert!(matches!(other, Err(NfsError::InvalidArgument(_))), "{other:?}");
    drop(hold);
    let mut last = first;
    let started = Instant::now();
    while !last.done {
        assert!(started.elapsed() < Duration::from_secs(120), "copy never finished: {last:?}");
        last = c.copy_tree_background(&e, "vol", "snap/data", Duration::from_millis(200)).await.expect("progress");
    }
    assert_eq!(last.bytes, 32 << 20, "every byte counted once");
    assert_eq!(fs::read(root.join("snap/data/d/big")).expect("copied"), data);
    assert!(!root.join("snap/.wasmcsi-copy-999999999-0-0").exists(), "the dead process's temporary was removed");
    // collected again (a retry after the answer was lost): still done
    assert!(c.copy_tree_background(&e, "vol", "snap/data", Duration::ZERO).await.expect("again").done);

    // a failing copy reports its error, once, and a retry starts over
    let missing = c.copy_tree_background(&e, "nope", "snap/other", Duration::from_secs(5)).await;
    assert!(matches!(missing, Err(NfsError::NotFound(_))), "{missing:?}");
    fs::create_dir(root.join("nope")).expect("now it exists");
    assert!(c.copy_tree_background(&e, "nope", "snap/other", Duration::from_secs(5)).await.expect("retry").done);

    // cancel: the copy stops, the target never appears
    fs::create_dir_all(root.join("snap2")).expect("parent");
    let hold = wasmcsi_nfs::hold_copies(&e);
    assert!(!c.copy_tree_background(&e, "vol", "snap2/data", Duration::ZERO).await.expect("start").done);
    c.cancel_copy(&e, "snap2/data").await;
    // Let go: a copy the cancel did not stop would now be placed.
    drop(hold);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!root.join("snap2/data").exists(), "a cancelled copy is never renamed into place");
    let left: Vec<_> =
        fs::read_dir(root.join("snap2")).expect("parent").map(|d| d.expect("entry").file_name()).collect();
    assert!(left.iter().all(|n| n.to_string_lossy().starts_with(".wasmcsi-copy-")), "{left:?}");
    c.cancel_copy(&e, "snap2/data").await; // absent: fine
}
