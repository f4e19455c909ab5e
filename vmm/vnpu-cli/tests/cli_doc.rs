//! `docs/cli.md` against the binary's own `--help`: every subcommand has a
//! section, every option a section's synopsis names exists, and every
//! option `--help` lists is documented in its command's section.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).arg("--help").output().unwrap();
    assert!(out.status.success(), "vnpu {args:?} --help: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The `--long` options a text names.
fn flags(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let mut end = start + 2;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'-') {
            end += 1;
        }
        let before_ok = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'-');
        if before_ok && end > start + 2 && b[start + 2].is_ascii_alphabetic() {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out.remove("--help");
    out
}

/// Subcommand names listed under `Commands:` of a help text.
fn subcommands(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in help.lines() {
        if line.starts_with("Commands:") {
            inside = true;
            continue;
        }
        if inside {
            if !line.starts_with("  ") {
                break;
            }
            if let Some(name) = line.split_whitespace().next() {
                if name != "help" && line.starts_with("  ") && !line.starts_with("   ") {
                    out.push(name.to_string());
                }
            }
        }
    }
    out
}

/// The options of a help text (its `Options:` section only).
fn options(help: &str) -> BTreeSet<String> {
    let text: String = help
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            t.starts_with("--") || (t.starts_with('-') && t.contains(", --"))
        })
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n");
    flags(&text)
}

/// Sections of cli.md: (the commands its heading names, heading, body).
fn sections() -> Vec<(Vec<Vec<String>>, String, String)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md")).unwrap();
    let mut out: Vec<(Vec<Vec<String>>, String, String)> = Vec::new();
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            // `vnpu a b [...]` or `vnpu a | b | c` or two synopses joined by " / ".
            let mut commands = Vec::new();
            for synopsis in h.split(" / ") {
                let s = synopsis.trim().trim_matches('`');
                let Some(rest) = s.strip_prefix("vnpu ") else { continue };
                if rest.contains(" | ") {
                    commands.extend(rest.split(" | ").map(|c| vec![c.trim().to_string()]));
                } else {
                    let words: Vec<String> = rest
                        .split_whitespace()
                        .take_while(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                        .map(String::from)
                        .collect();
                    commands.push(words);
                }
            }
            out.push((commands, h.to_string(), String::new()));
        } else if let Some(last) = out.last_mut() {
            last.2.push_str(line);
            last.2.push('\n');
        }
    }
    out
}

/// The command path a heading's words name (the longest prefix that is a subcommand path).
fn command_path(words: &[String]) -> Vec<String> {
    let mut path: Vec<String> = Vec::new();
    for w in words {
        let h = help(&path.iter().map(String::as_str).collect::<Vec<_>>());
        if subcommands(&h).contains(w) {
            path.push(w.clone());
        } else {
            break;
        }
    }
    path
}

#[test]
fn every_subcommand_has_a_section() {
    let secs = sections();
    let named: BTreeSet<Vec<String>> =
        secs.iter().flat_map(|s| s.0.iter().map(|c| command_path(c))).collect();
    let top = subcommands(&help(&[]));
    let mut missing = Vec::new();
    for c in &top {
        let sub = subcommands(&help(&[c.as_str()]));
        if sub.is_empty() {
            if !named.contains(&vec![c.clone()]) {
                missing.push(c.clone());
            }
        } else {
            for s in sub {
                if !named.contains(&vec![c.clone(), s.clone()]) {
                    missing.push(format!("{c} {s}"));
                }
            }
        }
    }
    assert!(missing.is_empty(), "docs/cli.md has no section for: {missing:?}");
}

#[test]
fn synopses_name_only_real_options_and_sections_document_every_option() {
    use std::collections::BTreeMap;
    let mut wrong = Vec::new();
    // A command may have several sections (`vnpu run --guest`, `--kernel`):
    // its options must be documented in one of them.
    let mut text: BTreeMap<Vec<String>, String> = BTreeMap::new();
    for (commands, heading, body) in sections() {
        let mut real = BTreeSet::new();
        for words in &commands {
            let path = command_path(words);
            if path.is_empty() {
                wrong.push(format!("`{heading}`: `vnpu {}` is not a command", words.join(" ")));
                continue;
            }
            real.extend(options(&help(&path.iter().map(String::as_str).collect::<Vec<_>>())));
            let t = text.entry(path).or_default();
            t.push_str(&heading);
            t.push('\n');
            t.push_str(&body);
        }
        for f in flags(&heading) {
            if !real.contains(&f) {
                wrong.push(format!("`{heading}`: {f} is not an option of that command"));
            }
        }
    }
    for (path, section_text) in &text {
        let documented = flags(section_text);
        for o in options(&help(&path.iter().map(String::as_str).collect::<Vec<_>>())) {
            if !documented.contains(&o) {
                wrong.push(format!("`vnpu {}`: {o} is not in its docs/cli.md section", path.join(" ")));
            }
        }
    }
    assert!(wrong.is_empty(), "docs/cli.md against --help:\n{}", wrong.join("\n"));
}
