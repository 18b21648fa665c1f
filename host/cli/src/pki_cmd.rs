//! `wasmcsi pki`: the built-in CA by hand. `init` makes a CA (`ca.crt`, `ca.key`), `issue`
//! writes a node's or the controller's credentials directory signed by it (the layout of a
//! Kubernetes TLS Secret: `ca.crt`, `tls.crt`, `tls.key`), `show` says what a credentials
//! directory holds and whether it would serve. The controller's authority endpoint issues node
//! certificates the same way without anyone running these; they are for the demo, tests, and
//! operators who issue by hand.
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use wasmcsi_trust::{Authority, Role, Validity};

#[derive(Subcommand)]
pub enum PkiCommand {
    /// Make a CA dedicated to wasmcsi in DIR: `ca.crt` (every process's trust anchor) and
    /// `ca.key` (0600; keep it in a Secret only the controller reads). Refuses to replace a CA.
    ///
    /// Example:  wasmcsi pki init --dir ./ca
    Init(InitArgs),
    /// Issue credentials for one node or the controller into DIR (`ca.crt`, `tls.crt`,
    /// `tls.key`), replacing what is there as one set (a running process reloads it).
    ///
    /// Example:  wasmcsi pki issue --ca ./ca --node worker-1 --out ./worker-1
    Issue(IssueArgs),
    /// Show a credentials directory: role, validity, issuer, whether the key matches the
    /// certificate and the chain verifies to `ca.crt`. Exits 1 when the set would not serve.
    Show(ShowArgs),
}

#[derive(Args)]
pub struct InitArgs {
    /// The CA's directory (created 0700).
    #[arg(long)]
    pub dir: PathBuf,
    /// How long the CA is valid (e.g. 3650d, 87600h).
    #[arg(long, value_parser = parse_validity, default_value = "3650d")]
    pub validity: Duration,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("role").required(true).args(["node", "controller"])))]
pub struct IssueArgs {
    /// The CA's directory, as `pki init` made it.
    #[arg(long)]
    pub ca: PathBuf,
    /// Issue for this node id (the Kubernetes node name).
    #[arg(long)]
    pub node: Option<String>,
    /// Issue for the controller.
    #[arg(long)]
    pub controller: bool,
    /// Where the credentials go.
    #[arg(long)]
    pub out: PathBuf,
    /// How long the certificate is valid (e.g. 24h, 90d, 30m).
    #[arg(long, value_parser = parse_validity, default_value = "24h")]
    pub validity: Duration,
}

#[derive(Args)]
pub struct ShowArgs {
    /// The credentials directory.
    pub dir: PathBuf,
}

/// `Ok(false)`: `show` found a set that would not serve.
pub fn run(command: PkiCommand) -> anyhow::Result<bool> {
    match command {
        PkiCommand::Init(args) => init(&args.dir, args.validity).map(|()| true),
        PkiCommand::Issue(args) => {
            let role = match (args.node, args.controller) {
                (Some(node), false) => Role::node(node)?,
                (None, true) => Role::Controller,
                // clap's group: exactly one of the two.
                _ => anyhow::bail!("give one of --node NAME and --controller"),
            };
            issue(&args.ca, &role, &args.out, args.validity).map(|()| true)
        }
        PkiCommand::Show(args) => show(&args.dir),
    }
}

fn init(dir: &Path, validity: Duration) -> anyhow::Result<()> {
    let ca = Authority::generate(Validity::starting_now(validity))?;
    ca.save(dir)?;
    println!("wrote {}/ca.crt and {}/ca.key (valid {})", dir.display(), dir.display(), span(validity));
    Ok(())
}

fn issue(ca_dir: &Path, role: &Role, out: &Path, validity: Duration) -> anyhow::Result<()> {
    let ca = Authority::load(ca_dir).with_context(|| format!("the CA in {}", ca_dir.display()))?;
    ca.issue(role, Validity::starting_now(validity))?.write(out, ca.bundle())?;
    println!("issued {role} into {} (valid {})", out.display(), span(validity));
    Ok(())
}

fn show(dir: &Path) -> anyhow::Result<bool> {
    let found = wasmcsi_trust::inspect::inspect(dir).with_context(|| format!("reading {}", dir.display()))?;
    let verdict = |r: &Result<(), String>| match r {
        Ok(()) => "yes".to_owned(),
        Err(why) => format!("NO: {why}"),
    };
    let now = SystemTime::now();
    let expiry = match found.not_after.duration_since(now) {
        Ok(left) => format!("in {}", span(left)),
        Err(past) => format!("EXPIRED {} ago", span(past.duration())),
    };
    println!("directory:    {}", dir.display());
    match &found.role {
        Ok(role) => println!("role:         {role} ({})", role.uri()),
        Err(why) => println!("role:         NONE: {why}"),
    }
    println!("subject:      {}", found.subject);
    println!("issuer:       {}", found.issuer);
    println!("valid from:   {}", utc(found.not_before));
    println!("expires:      {} ({expiry})", utc(found.not_after));
    println!("chain:        {} certificate(s) in tls.crt", found.chain_len);
    for ca in &found.anchors {
        println!("trusts:       {ca}");
    }
    println!("key matches:  {}", verdict(&found.key));
    println!("verifies:     {}", verdict(&found.trusted));
    Ok(found.usable())
}

/// `24h`, `90d`, `30m`, `3600s` (a bare number is seconds).
pub fn parse_validity(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a validity such as 24h, 90d or 30m");
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let unit_secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    match n.checked_mul(unit_secs) {
        Some(0) => Err(format!("{s:?}: a validity must be longer than nothing")),
        Some(secs) => Ok(Duration::from_secs(secs)),
        None => Err(bad()),
    }
}

/// `1d2h`, `23h59m`, `42s`: the two largest units.
fn span(d: Duration) -> String {
    let s = d.as_secs();
    let (days, hours, minutes, seconds) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60);
    match (days, hours, minutes) {
        (0, 0, 0) => format!("{seconds}s"),
        (0, 0, _) => format!("{minutes}m{seconds}s"),
        (0, _, _) => format!("{hours}h{minutes}m"),
        _ => format!("{days}d{hours}h"),
    }
}

fn utc(t: SystemTime) -> String {
    let format = &time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::from(t).format(format).unwrap_or_else(|_| format!("{t:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmcsi_trust::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};

    /// The defaults `--help` shows are the library's.
    #[test]
    fn validities_parse_with_units_and_refuse_nonsense() {
        assert_eq!(parse_validity("24h"), Ok(DEFAULT_LEAF_VALIDITY));
        assert_eq!(parse_validity("3650d"), Ok(DEFAULT_CA_VALIDITY));
        assert_eq!(parse_validity("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_validity("90"), Ok(Duration::from_secs(90)));
        for bad in ["", "h", "0h", "1y", "-1h", "99999999999999999999d"] {
            assert!(parse_validity(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn spans_read_as_their_two_largest_units() {
        assert_eq!(span(Duration::from_secs(86_400 + 7200 + 59)), "1d2h");
        assert_eq!(span(Duration::from_secs(3599)), "59m59s");
        assert_eq!(span(Duration::from_secs(7)), "7s");
    }
}
