//! Why the compiler refused part of a model, typed by whose side must change.

use thiserror::Error;

/// A part of a model (a node, a tensor, an attribute, an input) the
/// compiler refuses. The kind tells the user what to do: an
/// [`Refusal::Unsupported`] model is valid ONNX that needs another export
/// (or a compiler that handles more); an [`Refusal::Invalid`] one breaks
/// the ONNX rules and no compiler should take it.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum Refusal {
    /// Valid ONNX this compiler does not handle: an operator, an attribute
    /// value, a shape, a tensor too large for a vNPU.
    #[error("{0}")]
    Unsupported(String),
    /// A model that breaks the ONNX rules: a missing input, an attribute of
    /// the wrong type, shapes that do not agree, an index out of range; or
    /// a compile option (`--shape`) that contradicts the model.
    #[error("{0}")]
    Invalid(String),
}

impl Refusal {
    /// The same refusal with `more` appended to its text.
    pub fn with_hint(self, more: &str) -> Self {
        match self {
            Refusal::Unsupported(s) => Refusal::Unsupported(s + more),
            Refusal::Invalid(s) => Refusal::Invalid(s + more),
        }
    }

    /// Whether the model is valid ONNX the compiler does not handle.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Refusal::Unsupported(_))
    }
}

/// A refusal of valid ONNX the compiler does not handle.
pub(crate) fn unsupported(reason: impl Into<String>) -> Refusal {
    Refusal::Unsupported(reason.into())
}

/// A refusal of a model that breaks the ONNX rules.
pub(crate) fn invalid(reason: impl Into<String>) -> Refusal {
    Refusal::Invalid(reason.into())
}
