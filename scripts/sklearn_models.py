#!/usr/bin/env python3
"""Trains scikit-learn models on the data sets that ship inside scikit-learn
(no download), exports each with skl2onnx's defaults (ZipMap included) and
writes it with its input, for device/npu-onnx/tests/sklearn.rs, which
compiles them, runs them on the NPU model and compares every output with
ONNX Runtime's (docs/compiled-model-format.md, "scikit-learn models").

  .venv-onnx/bin/python scripts/sklearn_models.py OUT_DIR

LightGBM models are converted by onnxmltools, as LightGBM's users export
them. Writes OUT_DIR/<name>.onnx and OUT_DIR/<name>-X.npy for every model, and
OUT_DIR/models.txt, one name per line. Seeds are fixed: the same versions
of scikit-learn and skl2onnx (scripts/setup.sh pins them) write the same
models.
"""
import os
import sys
import warnings

import numpy as np
import onnx
from onnx import helper

warnings.filterwarnings("ignore")

from sklearn.cluster import KMeans  # noqa: E402
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits, load_iris, load_wine  # noqa: E402
from sklearn.decomposition import PCA  # noqa: E402
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis, QuadraticDiscriminantAnalysis  # noqa: E402
from sklearn.ensemble import (  # noqa: E402
    AdaBoostClassifier,
    ExtraTreesClassifier,
    GradientBoostingClassifier,
    GradientBoostingRegressor,
    RandomForestClassifier,
    RandomForestRegressor,
)
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.linear_model import (  # noqa: E402
    Lasso,
    LinearRegression,
    LogisticRegression,
    Perceptron,
    Ridge,
    RidgeClassifier,
    SGDClassifier,
)
from sklearn.naive_bayes import BernoulliNB, GaussianNB, MultinomialNB  # noqa: E402
from sklearn.neural_network import MLPClassifier, MLPRegressor  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import (  # noqa: E402
    Binarizer,
    KBinsDiscretizer,
    MaxAbsScaler,
    MinMaxScaler,
    Normalizer,
    OneHotEncoder,
    PolynomialFeatures,
    RobustScaler,
    StandardScaler,
)
from sklearn.svm import SVC, SVR, LinearSVC, LinearSVR, NuSVC  # noqa: E402
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor  # noqa: E402
from skl2onnx import to_onnx  # noqa: E402
import lightgbm  # noqa: E402
from onnxmltools import convert_lightgbm  # noqa: E402
from onnxmltools.convert.common.data_types import FloatTensorType  # noqa: E402


def data(loader):
    x, y = loader(return_X_y=True)
    return x.astype(np.float32), y


def v5(model):
    """A TreeEnsembleRegressor rewritten as ai.onnx.ml opset 5's TreeEnsemble
    (skl2onnx does not emit it yet), with the same trees."""
    g = model.graph
    old = next(n for n in g.node if n.op_type == "TreeEnsembleRegressor")
    a = {x.name: helper.get_attribute_value(x) for x in old.attribute}
    trees = sorted(set(a["nodes_treeids"]))
    feats, splits, modes, tid, fid, tleaf, fleaf, roots = [], [], [], [], [], [], [], []
    leaf_t, leaf_w = [], []
    index = {}
    leaves = {}
    for i, (t, nid, m) in enumerate(zip(a["nodes_treeids"], a["nodes_nodeids"], a["nodes_modes"])):
        if m != b"LEAF":
            index[(t, nid)] = len(feats)
            feats.append(a["nodes_featureids"][i])
            splits.append(a["nodes_values"][i])
            modes.append({b"BRANCH_LEQ": 0, b"BRANCH_LT": 1, b"BRANCH_GTE": 2, b"BRANCH_GT": 3}[m])
    weight = {}
    for t, nid, w in zip(a["target_treeids"], a["target_nodeids"], a["target_weights"]):
        weight[(t, nid)] = weight.get((t, nid), 0.0) + w
    for t, nid, m in zip(a["nodes_treeids"], a["nodes_nodeids"], a["nodes_modes"]):
        if m == b"LEAF":
            leaves[(t, nid)] = len(leaf_t)
            leaf_t.append(0)
            leaf_w.append(weight.get((t, nid), 0.0))
    for i, (t, nid, m) in enumerate(zip(a["nodes_treeids"], a["nodes_nodeids"], a["nodes_modes"])):
        if m == b"LEAF":
            continue
        for ids, out_id, out_leaf in (("nodes_truenodeids", tid, tleaf), ("nodes_falsenodeids", fid, fleaf)):
            c = (t, a[ids][i])
            if c in leaves:
                out_id.append(leaves[c])
                out_leaf.append(1)
            else:
                out_id.append(index[c])
                out_leaf.append(0)
    for t in trees:
        roots.append(index[(t, 0)])
    new = helper.make_node(
        "TreeEnsemble",
        list(old.input),
        list(old.output),
        domain="ai.onnx.ml",
        n_targets=1,
        aggregate_function=1,
        post_transform=0,
        tree_roots=roots,
        nodes_featureids=feats,
        nodes_splits=helper.make_tensor("s", onnx.TensorProto.FLOAT, [len(splits)], splits),
        nodes_modes=helper.make_tensor("m", onnx.TensorProto.UINT8, [len(modes)], modes),
        nodes_truenodeids=tid,
        nodes_trueleafs=tleaf,
        nodes_falsenodeids=fid,
        nodes_falseleafs=fleaf,
        leaf_targetids=leaf_t,
        leaf_weights=helper.make_tensor("w", onnx.TensorProto.FLOAT, [len(leaf_w)], leaf_w),
    )
    nodes = [new if n is old else n for n in g.node]
    graph = helper.make_graph(nodes, g.name, g.input, g.output, g.initializer)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 5)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    iris, wine, cancer, digits, diabetes = (
        data(load_iris),
        data(load_wine),
        data(load_breast_cancer),
        data(load_digits),
        data(load_diabetes),
    )
    rng = np.random.RandomState(0)
    # Iris with holes, for the imputer: every 7th value missing.
    holes = iris[0].copy()
    holes.reshape(-1)[::7] = np.nan
    cats = rng.randint(0, 4, size=(200, 3)).astype(np.int64)
    cats_y = (cats[:, 0] + cats[:, 1] > 3).astype(np.int64)
    models = {
        # The acceptance set, with skl2onnx's defaults.
        "scaler-logreg": (make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)), iris),
        "random-forest": (RandomForestClassifier(n_estimators=100, random_state=0), wine),
        "gradient-boosting-regressor": (GradientBoostingRegressor(random_state=0), diabetes),
        "svc-rbf": (SVC(kernel="rbf"), iris),
        "mlp": (MLPClassifier(hidden_layer_sizes=(32,), max_iter=500, random_state=0), digits),
        # Binary conventions, the other kernels and trees, preprocessing.
        "logreg-binary": (make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)), cancer),
        "random-forest-binary": (RandomForestClassifier(n_estimators=20, random_state=0), cancer),
        "gradient-boosting-binary": (GradientBoostingClassifier(n_estimators=20, random_state=0), cancer),
        "gradient-boosting-multi": (GradientBoostingClassifier(n_estimators=10, random_state=0), iris),
        # Ten classes: 45 pairs voting (with three, a wrong vote count can
        # still pick the right class).
        "svc-ten-classes": (SVC(kernel="rbf"), (digits[0][:300], digits[1][:300])),
        # Probabilities by pairwise coupling: only the label compiles.
        "svc-probability": (SVC(kernel="rbf", probability=True, random_state=0), iris),
        "svc-binary": (make_pipeline(StandardScaler(), SVC(kernel="rbf")), cancer),
        # Kernels other than RBF over standardized features, as scikit-learn
        # advises: over raw features their decision values cancel digits
        # (SVC(kernel="linear") on raw wine: kernel values near 1.7e6, decision
        # values near 5), and ONNX Runtime and the device then differ from
        # float64 and from each other by up to 0.2 (docs/compiled-model-format.md).
        "svc-poly": (make_pipeline(StandardScaler(), SVC(kernel="poly", degree=3)), iris),
        "svc-sigmoid": (make_pipeline(StandardScaler(), SVC(kernel="sigmoid")), wine),
        "svc-linear": (make_pipeline(StandardScaler(), SVC(kernel="linear")), wine),
        "linear-svc": (LinearSVC(random_state=0), iris),
        "svr": (make_pipeline(StandardScaler(), SVR()), diabetes),
        "linear-regression": (LinearRegression(), diabetes),
        "decision-tree": (DecisionTreeClassifier(random_state=0), digits),
        "random-forest-regressor": (RandomForestRegressor(n_estimators=10, max_depth=6, random_state=0), diabetes),
        "multi-output-tree": (DecisionTreeRegressor(max_depth=4, random_state=0), (iris[0][:, :2], iris[0][:, 2:])),
        "imputer-pipeline": (
            make_pipeline(SimpleImputer(), MinMaxScaler(), Normalizer(), Binarizer(threshold=0.3)),
            (holes, iris[1]),
        ),
        "imputer-logreg": (make_pipeline(SimpleImputer(), StandardScaler(), LogisticRegression()), (holes, iris[1])),
        "onehot": (OneHotEncoder(), (cats, cats_y)),
        "onehot-logreg": (make_pipeline(OneHotEncoder(), LogisticRegression()), (cats, cats_y)),
        # More of scikit-learn's estimators, each with skl2onnx's defaults.
        "adaboost": (AdaBoostClassifier(n_estimators=10, random_state=0), iris),
        "extra-trees": (ExtraTreesClassifier(n_estimators=20, random_state=0), iris),
        "gaussian-nb": (GaussianNB(), iris),
        "bernoulli-nb": (BernoulliNB(), iris),
        "multinomial-nb": (MultinomialNB(), iris),
        "lda": (LinearDiscriminantAnalysis(), iris),
        "qda": (QuadraticDiscriminantAnalysis(), iris),
        "kmeans": (KMeans(n_clusters=3, n_init=3, random_state=0), iris),
        "sgd": (SGDClassifier(random_state=0), iris),
        "ridge-classifier": (RidgeClassifier(), iris),
        "perceptron": (Perceptron(random_state=0), iris),
        "pca-logreg": (make_pipeline(PCA(n_components=2), LogisticRegression()), iris),
        "poly-ridge": (make_pipeline(PolynomialFeatures(2), Ridge()), diabetes),
        "robust-maxabs-logreg": (make_pipeline(RobustScaler(), MaxAbsScaler(), LogisticRegression()), iris),
        "kbins-logreg": (
            make_pipeline(KBinsDiscretizer(n_bins=3, encode="onehot-dense"), LogisticRegression()),
            iris,
        ),
        "lasso": (Lasso(), diabetes),
        "decision-tree-regressor": (DecisionTreeRegressor(max_depth=5, random_state=0), diabetes),
        "linear-svr": (LinearSVR(random_state=0), diabetes),
        "nu-svc": (NuSVC(), iris),
        "mlp-regressor": (MLPRegressor(max_iter=300, random_state=0), diabetes),
        # String class labels: the probabilities compile, the label not.
        "string-labels": (LogisticRegression(max_iter=500), (iris[0], np.array(["setosa", "versicolor", "virginica"])[iris[1]])),
        "normalizer-max": (Normalizer(norm="max"), wine),
        "normalizer-l1": (Normalizer(norm="l1"), wine),
    }
    names = []
    for name, (model, (x, y)) in models.items():
        if name == "kmeans":
            model.fit(x)
        else:
            model.fit(x, y)
        onx = to_onnx(model, x[:1])
        onnx.save(onx, os.path.join(out, f"{name}.onnx"))
        np.save(os.path.join(out, f"{name}-X.npy"), x)
        names.append(name)
    # LightGBM, as onnxmltools converts it (its newest opset, 15), on
    # breast cancer with holes (missing values go by the trees' default
    # directions) and on iris and diabetes.
    holed = cancer[0].copy()
    holed.reshape(-1)[::11] = np.nan
    for name, model, (x, y) in [
        ("lightgbm-multi", lightgbm.LGBMClassifier(n_estimators=20, random_state=0, verbose=-1), iris),
        ("lightgbm-missing", lightgbm.LGBMClassifier(n_estimators=20, random_state=0, verbose=-1), (holed, cancer[1])),
        ("lightgbm-regressor", lightgbm.LGBMRegressor(n_estimators=20, random_state=0, verbose=-1), diabetes),
    ]:
        model.fit(x, y)
        onx = convert_lightgbm(model, initial_types=[("X", FloatTensorType([None, x.shape[1]]))], target_opset=15)
        onnx.save(onx, os.path.join(out, f"{name}.onnx"))
        np.save(os.path.join(out, f"{name}-X.npy"), x)
        names.append(name)
    # LabelEncoder, which skl2onnx emits inside encoders: built here, as
    # ai.onnx.ml opset 2 defines it (int64 to int64, float to float, with
    # keys that are missing from the input and inputs missing from the keys).
    for name, keys, values, kind, default in [
        ("label-encoder-ints", [3, 1, 7, 2], [30, 10, 70, 20], onnx.TensorProto.INT64, ("default_int64", -5)),
        ("label-encoder-floats", [0.5, 1.5, -2.0], [5.0, 15.0, -20.0], onnx.TensorProto.FLOAT, ("default_float", 9.0)),
    ]:
        ints = kind == onnx.TensorProto.INT64
        attrs = {"keys_int64s" if ints else "keys_floats": keys, "values_int64s" if ints else "values_floats": values}
        attrs[default[0]] = default[1]
        node = helper.make_node("LabelEncoder", ["X"], ["Y"], domain="ai.onnx.ml", **attrs)
        graph = helper.make_graph(
            [node],
            name,
            [helper.make_tensor_value_info("X", kind, [None, 3])],
            [helper.make_tensor_value_info("Y", kind, [None, 3])],
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)])
        m.ir_version = 8
        onnx.save(m, os.path.join(out, f"{name}.onnx"))
        pool = np.array(keys + ([0, 5] if ints else [0.25, 3.0]))
        x = rng.choice(pool, size=(40, 3)).astype(np.int64 if ints else np.float32)
        np.save(os.path.join(out, f"{name}-X.npy"), x)
        names.append(name)
    # ai.onnx.ml opset 5's TreeEnsemble, from the regressor forest above.
    forest = RandomForestRegressor(n_estimators=10, max_depth=6, random_state=0).fit(*diabetes)
    onnx.save(v5(to_onnx(forest, diabetes[0][:1])), os.path.join(out, "tree-ensemble-v5.onnx"))
    np.save(os.path.join(out, "tree-ensemble-v5-X.npy"), diabetes[0])
    names.append("tree-ensemble-v5")
    with open(os.path.join(out, "models.txt"), "w") as f:
        f.write("\n".join(names) + "\n")


if __name__ == "__main__":
    main()
