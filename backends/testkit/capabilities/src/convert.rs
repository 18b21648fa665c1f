//! [`To`]: this world's generated types (what the backend passes and gets back) to and from the
//! SDK's (what its fakes take and return). Both come from the same WIT, so every conversion is
//! field by field and case by case, written once here by macro.
use crate::wit::exports::wasmcsi::backend as ours;
use wasmcsi_backend_sdk as sdk;

/// A conversion between the two bindings of one WIT type.
pub trait To<T> {
    fn to(self) -> T;
}

macro_rules! same {
    ($($t:ty),*) => {$(
        impl To<$t> for $t {
            fn to(self) -> $t {
                self
            }
        }
    )*};
}
same!((), String, u64, u32, i64, bool, u8);

impl<A: To<B>, B> To<Vec<B>> for Vec<A> {
    fn to(self) -> Vec<B> {
        self.into_iter().map(To::to).collect()
    }
}

impl<A: To<B>, B> To<Option<B>> for Option<A> {
    fn to(self) -> Option<B> {
        self.map(To::to)
    }
}

impl<A1: To<B1>, A2: To<B2>, B1, B2> To<(B1, B2)> for (A1, A2) {
    fn to(self) -> (B1, B2) {
        (self.0.to(), self.1.to())
    }
}

/// Records, both ways: `record!(a::T, b::T { field, ... })`.
macro_rules! record {
    ($($a:ident :: $t:ident, $b:ident :: $u:ident { $($f:ident),* $(,)? };)*) => {$(
        impl To<$b::$u> for $a::$t {
            fn to(self) -> $b::$u {
                $b::$u { $($f: self.$f.to()),* }
            }
        }
        impl To<$a::$t> for $b::$u {
            fn to(self) -> $a::$t {
                $a::$t { $($f: self.$f.to()),* }
            }
        }
    )*};
}

/// Enums (cases without payload) and variants whose cases all carry one payload, both ways.
macro_rules! cases {
    (unit $a:ident :: $t:ident, $b:ident :: $u:ident { $($c:ident),* $(,)? }) => {
        impl To<$b::$u> for $a::$t {
            fn to(self) -> $b::$u {
                match self { $($a::$t::$c => $b::$u::$c),* }
            }
        }
        impl To<$a::$t> for $b::$u {
            fn to(self) -> $a::$t {
                match self { $($b::$u::$c => $a::$t::$c),* }
            }
        }
    };
    (payload $a:ident :: $t:ident, $b:ident :: $u:ident { $($c:ident),* $(,)? }) => {
        impl To<$b::$u> for $a::$t {
            fn to(self) -> $b::$u {
                match self { $($a::$t::$c(x) => $b::$u::$c(x.to())),* }
            }
        }
        impl To<$a::$t> for $b::$u {
            fn to(self) -> $a::$t {
                match self { $($b::$u::$c(x) => $a::$t::$c(x.to())),* }
            }
        }
    };
}

mod t {
    pub use super::ours::types::*;
}
mod st {
    pub use wasmcsi_backend_sdk::types::*;
}
mod d {
    pub use super::ours::dir::*;
}
mod sd {
    pub use wasmcsi_backend_sdk::dir::*;
}
mod n {
    pub use super::ours::nfs::*;
}
mod sn {
    pub use wasmcsi_backend_sdk::nfs::*;
}
mod b {
    pub use super::ours::block::*;
}
mod sb {
    pub use wasmcsi_backend_sdk::block::*;
}
mod r {
    pub use super::ours::rbd::*;
}
mod sr {
    pub use wasmcsi_backend_sdk::rbd::*;
}
mod k {
    pub use super::ours::backup::*;
}
mod sk {
    pub use wasmcsi_backend_sdk::backup::*;
}

cases!(payload t::Error, st::Error {
    InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, OutOfRange, ResourceExhausted, Unavailable, Aborted,
    Unimplemented, DeadlineExceeded, PermissionDenied, Internal,
});
cases!(unit d::FileKind, sd::FileKind { Directory, File, Symlink, Other });
cases!(unit b::ReplicaState, sb::ReplicaState { Healthy, Rebuilding, Stale, Unreachable });
cases!(payload b::BlockSource, sb::BlockSource { Snapshot, Volume, Backup });
cases!(payload k::BackupSource, sk::BackupSource { BlockSnapshot, RbdSnapshot });
cases!(unit k::BackupState, sk::BackupState { InProgress, Ready, Failed });
record! {
    t::Pair, st::Pair { key, value };
    t::SecretRef, st::SecretRef { key, handle };
    t::Timestamp, st::Timestamp { seconds, nanos };
    t::IoLimits, st::IoLimits { read_iops, write_iops, read_bytes_per_second, write_bytes_per_second };
    d::FileStat, sd::FileStat { kind, size, mode, uid, gid, modified };
    d::Space, sd::Space { total_bytes, available_bytes };
    n::NfsExport, sn::NfsExport { server, share };
    n::CopyProgress, sn::CopyProgress { done, bytes };
    b::DiskInfo, sb::DiskInfo { name, free_bytes, total_bytes };
    b::NodeInfo, sb::NodeInfo { name, free_bytes, total_bytes, labels, replicas, disks };
    b::Placement, sb::Placement { node, disk };
    b::Replica, sb::Replica { node, disk, state, down_since, rebuilt_bytes, rebuild_total_bytes };
    b::Standby, sb::Standby { target, source_volume, last_backup };
    b::ReplicaSet, sb::ReplicaSet {
        id, size_bytes, replicas, attached_to, metadata, created, filling, limits, rebuild_bytes_per_second, standby
    };
    b::BlockSnapshot, sb::BlockSnapshot { name, volume_id, size_bytes, created };
    r::ImageInfo, sr::ImageInfo { name, size_bytes, features, parent, metadata };
    r::ImageSnapshot, sr::ImageSnapshot { name, size_bytes, protected, created };
    r::CopyProgress, sr::CopyProgress { done, bytes };
    r::PoolStats, sr::PoolStats { total_bytes, available_bytes };
    r::RbdPool, sr::RbdPool { cluster, pool, secrets };
    k::RbdSnapshot, sk::RbdSnapshot { cluster, pool, image, snapshot };
    k::BackupInfo, sk::BackupInfo {
        id, target, volume_id, snapshot, size_bytes, created, state, uploaded_bytes, total_bytes, labels, error
    };
}

/// A fake's answer as this world's.
pub fn answer<A: To<B>, B>(r: Result<A, sdk::Error>) -> Result<B, t::Error> {
    r.map(To::to).map_err(To::to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_keeps_its_case_and_message_both_ways() {
        let e: t::Error = st::Error::FailedPrecondition("volume v has snapshots".into()).to();
        assert_eq!(format!("{e:?}"), format!("{:?}", t::Error::FailedPrecondition("volume v has snapshots".into())));
        let back: st::Error = e.to();
        assert!(matches!(back, st::Error::FailedPrecondition(m) if m == "volume v has snapshots"));
    }

    #[test]
    fn a_replica_set_converts_with_its_nested_fields() {
        let set = sb::ReplicaSet {
            id: "v".into(),
            size_bytes: 4096,
            replicas: vec![sb::Replica {
                node: "n1".into(),
                disk: Some("default".into()),
                state: sb::ReplicaState::Stale,
                down_since: Some(st::Timestamp { seconds: 5, nanos: 1 }),
                rebuilt_bytes: 0,
                rebuild_total_bytes: 0,
            }],
            attached_to: None,
            metadata: vec![st::Pair { key: "k".into(), value: "v".into() }],
            created: st::Timestamp { seconds: 1, nanos: 0 },
            filling: Some((1, 2)),
            limits: st::IoLimits::UNLIMITED,
            rebuild_bytes_per_second: 0,
            standby: Some(sb::Standby { target: "t".into(), source_volume: "src".into(), last_backup: None }),
        };
        let ours: b::ReplicaSet = set.clone().to();
        assert_eq!(ours.replicas[0].down_since.map(|t| t.seconds), Some(5));
        assert!(matches!(ours.replicas[0].state, b::ReplicaState::Stale));
        let back: sb::ReplicaSet = ours.to();
        assert_eq!(back, set);
    }
}
