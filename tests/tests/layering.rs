//! The workspace's layering (`docs/architecture.md`, "Crates and layers"),
//! checked on `cargo metadata`: every crate sits in its folder of the same
//! name, depends only on crates of lower layers, no production crate
//! depends on an evaluation crate, and the board daemon and the `vnpu`
//! binary link no ML or plotting crate.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;

/// The layers, lowest first: a crate may depend on crates of lower layers
/// only. Keep in step with the table in `docs/architecture.md`.
const LAYERS: &[&[&str]] = &[
    // The ISA and guest ABI, shared with guests (no_std).
    &["vnpu-abi"],
    // The NPU model and what is defined on the ISA or the ABI alone.
    &["npu-model", "npu-reference", "npu-graph", "npu-infer-io", "vnpu-driver", "vfio_user"],
    // Code generation, the scheduling policy, the model's differential
    // test, the guest images' programs (tested on the model).
    &["npu-lower", "npu-scheduler", "npu-difftest", "vnpu-guest-programs", "vnpu-pci", "vnpu-spec"],
    // Programs from workloads and ONNX; the board runtime.
    &["npu-workloads", "npu-onnx", "npu-board-runtime"],
    // Interference on the board model; the PCI function.
    &["npu-interference", "vnpu-device"],
    // Placement; the VM.
    &["vnpu-placement", "vnpu-vm"],
    // Management: the state store and the control protocol.
    &["vnpu-manager"],
    // The board daemon.
    &["vnpu-daemon"],
    // The `vnpu` binary; the fuzz targets' harnesses (nothing depends on them).
    &["vnpu-cli", "vnpu-fuzz-harness"],
    // Evaluations and integration tests: nothing but another evaluation
    // depends on them.
    &["interference-eval"],
    &["npu-bench", "placement-eval", "daemon-bench", "vnpu-tests"],
];

/// The evaluation crates (in `eval/`).
const EVALUATIONS: &[&str] = &["interference-eval", "npu-bench", "placement-eval", "daemon-bench"];

/// Crates that only evaluations may link.
const EVALUATION_ONLY: &[&str] = &["smartcore", "plotters", "linfa", "rand_distr", "libloading"];

struct Workspace {
    /// Name -> (manifest folder relative to the root, direct dependencies in the workspace).
    members: BTreeMap<String, (String, BTreeSet<String>)>,
    /// Package id -> name, and id -> ids of its normal dependencies (resolved).
    names: BTreeMap<String, String>,
    normal: BTreeMap<String, Vec<String>>,
}

fn workspace() -> Workspace {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: BTreeSet<&str> =
        meta["workspace_members"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let mut members = BTreeMap::new();
    let mut names = BTreeMap::new();
    let in_workspace: BTreeSet<String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| ids.contains(p["id"].as_str().unwrap()))
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_string();
        names.insert(p["id"].as_str().unwrap().to_string(), name.clone());
        if !ids.contains(p["id"].as_str().unwrap()) {
            continue;
        }
        let manifest = Path::new(p["manifest_path"].as_str().unwrap());
        let folder = manifest.parent().unwrap().strip_prefix(&root).unwrap().display().to_string();
        let deps = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_string())
            .filter(|d| in_workspace.contains(d))
            .collect();
        members.insert(name, (folder, deps));
    }
    let mut normal = BTreeMap::new();
    for n in meta["resolve"]["nodes"].as_array().unwrap() {
        let deps = n["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null()))
            .map(|d| d["pkg"].as_str().unwrap().to_string())
            .collect();
        normal.insert(n["id"].as_str().unwrap().to_string(), deps);
    }
    Workspace { members, names, normal }
}

fn layer_of(name: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&name))
}

#[test]
fn every_crate_is_in_a_folder_of_its_name_and_in_a_layer() {
    let ws = workspace();
    for (name, (folder, _)) in &ws.members {
        let last = folder.rsplit('/').next().unwrap();
        // The integration tests are the workspace's `tests/` folder.
        if name != "vnpu-tests" && name != "vnpu-driver" {
            assert_eq!(last, name, "crate `{name}` lives in `{folder}`: name its folder as the crate");
        }
        assert!(
            layer_of(name).is_some(),
            "crate `{name}` is in no layer of LAYERS (tests/tests/layering.rs)"
        );
        let top = folder.split('/').next().unwrap();
        let evaluation = EVALUATIONS.contains(&name.as_str());
        assert_eq!(
            top == "eval",
            evaluation,
            "crate `{name}` in `{folder}`: evaluations, and only they, live in eval/"
        );
    }
}

#[test]
fn crates_depend_only_on_lower_layers() {
    let ws = workspace();
    let mut wrong = Vec::new();
    for (name, (folder, deps)) in &ws.members {
        let own = layer_of(name).unwrap_or(usize::MAX);
        for d in deps {
            let theirs = layer_of(d).unwrap_or(usize::MAX);
            if theirs >= own && d != name {
                wrong.push(format!("{name} (layer {own}) -> {d} (layer {theirs})"));
            }
            // Nothing but an evaluation or the tests depends on an evaluation.
            if EVALUATIONS.contains(&d.as_str())
                && !EVALUATIONS.contains(&name.as_str())
                && name != "vnpu-tests"
            {
                wrong.push(format!("{name} -> evaluation crate {d}"));
            }
            // The NPU side never reaches up into the hypervisor.
            if folder.starts_with("device/") && ws.members[d].0.starts_with("vmm/") {
                wrong.push(format!("{name} in device/ -> {d} in vmm/"));
            }
        }
    }
    assert!(wrong.is_empty(), "dependencies against the layering:\n{}", wrong.join("\n"));
}

#[test]
fn the_daemon_and_the_vnpu_binary_link_no_evaluation_crate() {
    let ws = workspace();
    for top in ["vnpu-daemon", "vnpu-cli"] {
        let id = ws.names.iter().find(|(_, n)| *n == top).map(|(id, _)| id.clone()).unwrap();
        let mut seen = BTreeSet::new();
        let mut stack = vec![id];
        while let Some(i) = stack.pop() {
            if seen.insert(i.clone()) {
                stack.extend(ws.normal.get(&i).cloned().unwrap_or_default());
            }
        }
        let linked: BTreeSet<&str> = seen.iter().map(|i| ws.names[i].as_str()).collect();
        for bad in EVALUATION_ONLY.iter().chain(EVALUATIONS.iter()) {
            assert!(!linked.contains(bad), "`{top}` links `{bad}`: keep it to the evaluation crates");
        }
        // The check sees the daemon's real dependencies.
        assert!(linked.contains("vnpu-device") && linked.contains("vfio_user"), "{linked:?}");
    }
}
