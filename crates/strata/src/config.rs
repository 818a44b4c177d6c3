//! Where settings come from besides the command line: every long flag of every command can
//! also be given as a `STRATA_*` variable (`--max-sessions` is `STRATA_MAX_SESSIONS`) and in a
//! TOML file named by `--config FILE` (or `STRATA_CONFIG`). A flag on the command line wins over
//! its variable, the variable over the file, the file over the built-in default.
//!
//! The file holds one table per command, keyed by the flags' long names, and the flags every
//! command has (`log-format`) at its top:
//!
//! ```toml
//! log-format = "json"
//!
//! [tracker]
//! registry = "http://10.0.0.5:2379"
//! api-keys = "/etc/strata/keys"
//! public-metrics = true
//!
//! [shard]
//! model = "/models/qwen2.5-coder-1.5b-q4_k_m.gguf"
//! layers = "0..14"
//! threads = 8
//! ```
//!
//! Nothing in it is ignored: a key that is no flag of its command, a table that is no command,
//! or a value its flag does not accept is an error naming it (in any command's table for plain
//! values: numbers, switches, strings; a model path or an instruction set only in the running
//! command's, as checking them looks for the file or at the CPU). Only the running command's
//! table applies. The file is a regular file of at most 1 MiB: a device, a FIFO or a directory
//! is refused without being read (a FIFO could block, a device never end).

use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, Command};

/// The variable that gives a long flag its value: `STRATA_` and the name in capitals, with
/// `_` for `-`.
pub fn env_name(long: &str) -> String {
    format!("STRATA_{}", long.replace('-', "_").to_uppercase())
}

/// `cmd` with a `STRATA_*` variable on every long flag of it and of its subcommands (except
/// `--help` and `--version`).
pub fn with_env(cmd: Command) -> Command {
    let flags: Vec<(clap::Id, String)> = cmd
        .get_arguments()
        .filter(|a| a.get_env().is_none() && !matches!(a.get_id().as_str(), "help" | "version"))
        .filter_map(|a| Some((a.get_id().clone(), a.get_long()?.to_string())))
        .collect();
    let mut cmd = flags.into_iter().fold(cmd, |cmd, (id, long)| {
        cmd.mut_arg(id, |a| a.env(env_name(&long)))
    });
    let subs: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for name in subs {
        cmd = cmd.mut_subcommand(name, with_env);
    }
    cmd
}

/// The variables of a command's flags (`strata serve` removes its shards' from their
/// environment: a shard takes its settings from the flags serve gives it).
pub fn env_names(cmd: &Command) -> Vec<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .chain(["STRATA_CONFIG".to_string()])
        .collect()
}

/// `root` (built with [`with_env`]) with the settings of the file `args` name (with
/// `--config`, else `STRATA_CONFIG`) as its defaults, for the command `args` run.
pub fn apply_file(root: Command, args: &[std::ffi::OsString]) -> Result<Command, String> {
    // What the command line asks for, before anything is required: the file and the command.
    let Ok(seen) = root.clone().ignore_errors(true).try_get_matches_from(args) else {
        return Ok(root); // --help, --version: the real parse shows them
    };
    let Some(path) = seen.get_one::<PathBuf>("config").cloned() else {
        return Ok(root);
    };
    let mut running = Vec::new();
    let mut m = &seen;
    while let Some((name, sub)) = m.subcommand() {
        running.push(name.to_string());
        m = sub;
    }
    let text = read_config(&path).map_err(|e| format!("--config {}: {e}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| format!("--config {}: {e}", path.display()))?;
    apply(root, &table, &running, &[], &path)
}

/// Most bytes a config file may hold.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of a config file: a regular file (opened without blocking, so a FIFO named by
/// mistake is refused, not waited on) of at most [`MAX_CONFIG_BYTES`].
fn read_config(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "{} bytes, more than a config file may hold ({MAX_CONFIG_BYTES})",
            meta.len()
        ));
    }
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!(
            "more than a config file may hold ({MAX_CONFIG_BYTES} bytes)"
        ));
    }
    Ok(text)
}

/// Applies `table` to `cmd` (at `at`, the subcommand path from the root): its plain keys are
/// flags of `cmd` (checked always, set only when `cmd` is on the `running` path), its tables
/// subcommands.
fn apply(
    mut cmd: Command,
    table: &toml::Table,
    running: &[String],
    at: &[String],
    file: &Path,
) -> Result<Command, String> {
    let here = if at.is_empty() {
        "the top".to_string()
    } else {
        format!("[{}]", at.join("."))
    };
    let on_path = running.starts_with(at);
    for (key, value) in table {
        if let toml::Value::Table(sub) = value {
            if cmd.find_subcommand(key).is_none() {
                return Err(format!(
                    "--config {}: [{}] is not a command of strata",
                    file.display(),
                    at.iter()
                        .chain([key])
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(".")
                ));
            }
            let mut path = at.to_vec();
            path.push(key.clone());
            let mut err = None;
            cmd = cmd.mut_subcommand(key, |sc| {
                apply(sc.clone(), sub, running, &path, file).unwrap_or_else(|e| {
                    err = Some(e);
                    sc
                })
            });
            if let Some(e) = err {
                return Err(e);
            }
            continue;
        }
        let named = |a: &&Arg| a.get_long() == Some(key.as_str()) && a.get_id() != "config";
        let Some(arg) = cmd.get_arguments().find(named).cloned() else {
            let command = if at.is_empty() {
                "every command".to_string()
            } else {
                format!("`strata {}`", at.join(" "))
            };
            return Err(format!(
                "--config {}: `{key}` (at {here}) is not a flag of {command}",
                file.display()
            ));
        };
        let values = strings(value)
            .map_err(|e| format!("--config {}: `{key}` (at {here}): {e}", file.display()))?;
        let many = matches!(arg.get_action(), ArgAction::Append)
            || arg.get_num_args().is_some_and(|n| n.max_values() > 1);
        if values.len() != 1 && !many {
            return Err(format!(
                "--config {}: `{key}` (at {here}) takes one value, not a list",
                file.display()
            ));
        }
        // Another command's values are checked too where their parser is plain (numbers,
        // switches, strings): a model path would be looked for, or fetched, and an instruction
        // set checked against this CPU, which only the command that runs may do.
        if on_path || plain(&arg) {
            check(&arg, key, &values).map_err(|e| {
                let e = e.trim().trim_start_matches("error: ");
                format!("--config {}: `{key}` (at {here}): {e}", file.display())
            })?;
        }
        if !on_path {
            continue;
        }
        cmd = cmd.mut_arg(arg.get_id().clone(), |a| {
            a.default_values(values)
                .required(false)
                .required_unless_present(clap::builder::Resettable::<clap::Id>::Reset)
        });
    }
    Ok(cmd)
}

/// Whether `arg`'s values parse to a number, a switch or a string: checking them has no
/// effect beyond the answer.
fn plain(arg: &Arg) -> bool {
    use std::any::TypeId;
    let t = arg.get_value_parser().type_id();
    [
        TypeId::of::<bool>(),
        TypeId::of::<String>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i64>(),
        TypeId::of::<f32>(),
        TypeId::of::<f64>(),
    ]
    .into_iter()
    .any(|p| t == p)
}

/// Whether `arg` accepts `values` (its value parser says so, as for the command line; a
/// switch takes `true` or `false`), before they become its defaults.
fn check(arg: &Arg, long: &str, values: &[String]) -> Result<(), String> {
    if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return match values {
            [v] if v == "true" || v == "false" => Ok(()),
            _ => Err(format!("a switch is `true` or `false`, not {values:?}")),
        };
    }
    // A command of this one flag, without the relations to others the real one has.
    let probe = Command::new("strata-config").no_binary_name(true).arg(
        Arg::new("value")
            .long(long.to_string())
            .value_parser(arg.get_value_parser().clone())
            .action(ArgAction::Append)
            .allow_hyphen_values(true),
    );
    let argv = values.iter().flat_map(|v| [format!("--{long}"), v.clone()]);
    probe
        .try_get_matches_from(argv)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A TOML value as the command line would give it.
fn strings(v: &toml::Value) -> Result<Vec<String>, String> {
    Ok(match v {
        toml::Value::String(s) => vec![s.clone()],
        toml::Value::Integer(i) => vec![i.to_string()],
        toml::Value::Float(f) => vec![f.to_string()],
        toml::Value::Boolean(b) => vec![b.to_string()],
        toml::Value::Datetime(d) => vec![d.to_string()],
        toml::Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    toml::Value::Array(_) | toml::Value::Table(_) => {
                        return Err("a list holds plain values only".to_string())
                    }
                    plain => out.extend(strings(plain)?),
                }
            }
            out
        }
        toml::Value::Table(_) => return Err("a table is not a flag's value".to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long, global = true)]
        config: Option<PathBuf>,
        #[arg(long, global = true, default_value = "text")]
        log_format: String,
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Sub {
        Shard {
            #[arg(long)]
            layers: String,
            #[arg(long, default_value_t = 4)]
            threads: usize,
            #[arg(long)]
            quiet: bool,
            #[arg(long)]
            stop: Vec<String>,
            #[arg(long, default_value = "127.0.0.1:0", value_parser = crate::cluster_cmd::listen_addr)]
            listen: String,
        },
        Tracker {
            #[arg(long)]
            registry: Option<String>,
            #[arg(long, default_value_t = 100)]
            health_period_ms: u64,
            /// Stands for a model path: checking it would have an effect.
            #[arg(long, value_parser = |_: &str| Err::<PathBuf, _>("looked at".to_string()))]
            model: Option<PathBuf>,
        },
    }

    fn parse(file: &str, args: &[&str]) -> Result<Cli, String> {
        use clap::{CommandFactory, FromArgMatches};
        let dir = std::env::temp_dir().join(format!("strata-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{}.toml", file.len()));
        std::fs::write(&path, file).unwrap();
        let mut argv: Vec<std::ffi::OsString> = vec!["strata".into()];
        argv.extend(args.iter().map(|a| a.into()));
        argv.push("--config".into());
        argv.push(path.clone().into());
        let cmd = apply_file(Cli::command(), &argv)?;
        let m = cmd.try_get_matches_from(argv).map_err(|e| e.to_string())?;
        Cli::from_arg_matches(&m).map_err(|e| e.to_string())
    }

    #[test]
    fn the_file_fills_what_the_command_line_leaves_and_the_command_line_wins() {
        let file = "log-format = \"json\"\n[shard]\nlayers = \"0..4\"\nthreads = 2\n\
                    quiet = true\nstop = [\"a\", \"b\"]\n[tracker]\nregistry = \"http://x\"\n";
        let cli = parse(file, &["shard"]).unwrap();
        assert_eq!(cli.log_format, "json");
        let Sub::Shard {
            layers,
            threads,
            quiet,
            stop,
            ..
        } = cli.command
        else {
            panic!("not shard")
        };
        assert_eq!((layers.as_str(), threads, quiet), ("0..4", 2, true));
        assert_eq!(stop, ["a", "b"]);
        let cli = parse(file, &["shard", "--threads", "7", "--layers", "1..2"]).unwrap();
        let Sub::Shard {
            layers, threads, ..
        } = cli.command
        else {
            panic!("not shard")
        };
        assert_eq!((layers.as_str(), threads), ("1..2", 7));
        // A required flag the file does not give is still required.
        let e = parse("[tracker]\nregistry = \"http://x\"\n", &["shard"]).unwrap_err();
        assert!(e.contains("--layers"), "{e}");
    }

    #[test]
    fn nothing_in_the_file_is_ignored() {
        let cases = [
            (
                "[shard]\nlayers = \"0..4\"\nthreds = 2\n",
                "`threds` (at [shard]) is not a flag of `strata shard`",
            ),
            ("[shrd]\nlayers = \"0..4\"\n", "[shrd] is not a command"),
            (
                "layers = \"0..4\"\n",
                "`layers` (at the top) is not a flag of every command",
            ),
            (
                "[shard]\nlayers = \"0..4\"\nthreads = \"many\"\n",
                "`threads` (at [shard]): invalid value 'many'",
            ),
            (
                "[shard]\nlayers = [\"0..4\", \"4..8\"]\n",
                "takes one value, not a list",
            ),
            // The other commands' tables are checked too.
            (
                "[shard]\nlayers = \"0..4\"\n[tracker]\nregistri = \"x\"\n",
                "`registri` (at [tracker])",
            ),
            // And their values, though only the running command's apply.
            (
                "[shard]\nlayers = \"0..4\"\n[tracker]\nhealth-period-ms = \"x\"\n",
                "`health-period-ms` (at [tracker]): invalid value 'x'",
            ),
            (
                "[shard]\nlayers = \"0..4\"\nlisten = 5\n",
                "`listen` (at [shard]): invalid value '5'",
            ),
            ("[shard\n", "TOML parse error"),
        ];
        for (file, want) in cases {
            let e = parse(file, &["shard"]).unwrap_err();
            assert!(e.contains(want), "{file:?}: {e}");
        }
        // A value whose check would look for a file or at the CPU is left to its own command.
        assert!(parse(
            "[shard]\nlayers = \"0..4\"\n[tracker]\nmodel = \"m\"\n",
            &["shard"]
        )
        .is_ok());
        let e = parse("[tracker]\nmodel = \"m\"\n", &["tracker"]).unwrap_err();
        assert!(e.contains("looked at"), "{e}");
    }

    /// A config file is a regular file of bounded size: a device, a FIFO or a directory is
    /// refused without reading (a FIFO would block forever), and so is a file too large.
    #[test]
    fn only_a_bounded_regular_file_is_read() {
        let dir = std::env::temp_dir().join(format!("strata-config-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let big = dir.join("big.toml");
        std::fs::write(&big, "#".repeat(2 << 20)).unwrap();
        for (path, want) in [
            (Path::new("/dev/zero"), "not a regular file"),
            (fifo.as_path(), "not a regular file"),
            (dir.as_path(), "not a regular file"),
            (big.as_path(), "more than a config file may hold"),
        ] {
            let e = read_config(path).unwrap_err();
            assert!(e.contains(want), "{}: {e}", path.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_long_flag_has_its_variable() {
        let cmd = with_env(<Cli as clap::CommandFactory>::command());
        let shard = cmd.find_subcommand("shard").unwrap();
        let mut names = env_names(shard);
        names.sort();
        assert_eq!(
            names,
            [
                "STRATA_CONFIG",
                "STRATA_LAYERS",
                "STRATA_LISTEN",
                "STRATA_QUIET",
                "STRATA_STOP",
                "STRATA_THREADS"
            ]
        );
        assert_eq!(env_name("max-sessions"), "STRATA_MAX_SESSIONS");
    }
}
