//! Where a problem lies (the event, the field, the list index) and the [`SchemaError`] that
//! says so in `decode_batch`'s words.

use std::fmt;

use super::generic::{GenericError, Segment};
use crate::msgpack::Lax;

/// A payload that is not a valid vLLM batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// The event the error lies in, when it lies in one.
    pub event_index: Option<usize>,
    /// The field, with a list index where there is one (`token_ids[3]`).
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SchemaError {}

/// Where an error lies: an event's field, and up to two list indices in it
/// (`lookahead_token_ids[1][3]`).
#[derive(Clone, Copy)]
pub(super) struct At<'f> {
    pub(super) event: usize,
    field: &'f str,
    elements: [usize; 2],
    depth: u8,
}

impl<'f> At<'f> {
    pub(super) fn new(event: usize, field: &'f str) -> Self {
        At {
            event,
            field,
            elements: [0; 2],
            depth: 0,
        }
    }

    pub(super) fn name(&self) -> String {
        let mut name = self.field.to_string();
        for element in &self.elements[..usize::from(self.depth)] {
            name.push_str(&format!("[{element}]"));
        }
        name
    }

    pub(super) fn error(&self, text: impl fmt::Display) -> SchemaError {
        event_error(self.event, &self.name(), text)
    }

    pub(super) fn at(&self, element: usize) -> At<'f> {
        let mut inner = *self;
        inner.elements[usize::from(self.depth).min(1)] = element;
        inner.depth = (self.depth + 1).min(2);
        inner
    }

    /// The error of a value inside this one that msgspec decoded as `Any` (an extra key).
    pub(super) fn generic_error(&self, error: GenericError) -> SchemaError {
        match error {
            GenericError::Malformed(text) => malformed_event(self.event, text),
            GenericError::Timestamp { text, path } => {
                // A path through a map key reads "`key` in `$...`" in msgspec's error, which
                // decode_batch cannot map to a field.
                if path.contains(&Segment::Key) {
                    return event_error(self.event, "event", text);
                }
                let mut name = self.name();
                for segment in path {
                    match segment {
                        Segment::Index(index) => name.push_str(&format!("[{index}]")),
                        Segment::Value => name.push_str("[...]"),
                        Segment::Key => unreachable!("checked above"),
                    }
                }
                event_error(self.event, &name, text)
            }
        }
    }
}

pub(super) fn batch_error(text: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: None,
        field: None,
        message: format!("batch: {text}"),
    }
}

pub(super) fn malformed_batch(error: impl fmt::Display) -> SchemaError {
    batch_error(format!("malformed msgpack: {error}"))
}

pub(super) fn event_error(index: usize, field: &str, text: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: Some(index),
        field: Some(field.to_string()),
        message: format!("event {index}: field '{field}': {text}"),
    }
}

pub(super) fn malformed_event(index: usize, error: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: Some(index),
        field: None,
        message: format!("event {index}: malformed msgpack: {error}"),
    }
}

pub(super) fn expected(what: &str, item: &Lax<'_>) -> String {
    format!("Expected `{what}`, got `{}`", item.type_name())
}
