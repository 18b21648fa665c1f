//! The checks component of a composed backend test (`wasmcsi backend compose`): the controller
//! checks of `wasmcsi backend check`, at the WIT level. It calls the backend's `driver` exports
//! directly (the `wasmcsi:testkit/checks` world), prints the same PASS/FAIL/SKIP report, and
//! exits 1 when a check failed or its arguments are wrong (WASI 0.2's `exit` carries no other
//! code: the usage on stderr tells the two apart).
//!
//! ```text
//! wasmtime run --dir ROOT::/ BACKEND-test.wasm [--param KEY=VALUE]... [--secret KEY]...
//! ```
//!
//! `--param` are the StorageClass parameters of the volumes it makes; `--secret KEY` passes a
//! secret reference named KEY with every call that takes secrets (the test kit's capabilities
//! accept any handle). What it checks and why each check exists is in [`suite`]; it does not
//! check the host's own answers (gRPC codes of missing fields, the `backend` parameter, node
//! calls, concurrency): `wasmcsi backend check` does, against a real host.
#![deny(unsafe_code)]

mod suite;

#[allow(unsafe_code, reason = "wit-bindgen expands to the canonical ABI's unsafe glue")]
mod wit {
    wit_bindgen::generate!({
        path: ["../../../wit", "../../../wit/testkit"],
        world: "wasmcsi:testkit/checks@0.1.0",
        // The interfaces are wasmcsi:backend's (another package): generate their bindings here.
        generate_all,
        // The checks compare whole answers (a clone's content source).
        additional_derives: [PartialEq],
    });
}

const USAGE: &str = "usage: wasmtime run --dir ROOT::/ BACKEND-test.wasm [--param KEY=VALUE]... [--secret KEY]...";

/// What the command line asks for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Args {
    params: Vec<(String, String)>,
    secrets: Vec<String>,
}

fn parse(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut out = Args::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let mut value = || inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--param" => {
                let v = value()?;
                let (k, v) = v.split_once('=').ok_or_else(|| format!("--param {v:?} is not KEY=VALUE"))?;
                out.params.push((k.to_owned(), v.to_owned()));
            }
            "--secret" => out.secrets.push(value()?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(out)
}

fn main() {
    // args[0] is the component's name.
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            std::process::exit(1);
        }
    };
    let report = suite::run(&args.params, &args.secrets);
    println!("\nchecks (controller, at the WIT level):");
    print!("{}", report.render());
    std::process::exit(if report.passed() { 0 } else { 1 });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn params_and_secrets_parse_in_both_spellings() {
        let a = parse(strings(&["--param", "server=h", "--param=share=/e", "--secret", "userKey"])).expect("parses");
        assert_eq!(a.params, vec![("server".into(), "h".into()), ("share".into(), "/e".into())]);
        assert_eq!(a.secrets, vec!["userKey".to_string()]);
    }

    #[test]
    fn bad_arguments_are_refused() {
        assert!(parse(strings(&["--param", "noequals"])).is_err());
        assert!(parse(strings(&["--param"])).is_err());
        assert!(parse(strings(&["--what"])).is_err());
    }
}
