//! One AdmissionReview in, one out: decoding, the policy, the JSONPatch.
//!
//! A review that cannot be read is an error ([`ReviewError`]), answered by
//! the server with HTTP 400 and a `Status` naming what is wrong, which the
//! API server logs and, under `failurePolicy: Ignore`, treats as "admit
//! unchanged". A review that can be read is always allowed: this webhook
//! adds a field, it never refuses a pod.
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Pod;
use kube::core::admission::{self, AdmissionRequest, AdmissionReview, Operation};
use serde::Serialize;

use super::cache::VolumeCache;
use super::policy::{self, HOST_TO_CONTAINER, Plan, Scope};
use super::selection::Selection;

#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("the body is not an AdmissionReview of a Pod: at {path}")]
    Malformed {
        /// Where in the document decoding stopped (`.` for the top).
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("expected kind AdmissionReview of apiVersion {expected}, got kind {kind:?} of apiVersion {api_version:?}")]
    WrongType { kind: String, api_version: String, expected: &'static str },
    #[error("the AdmissionReview has no request")]
    NoRequest,
    #[error("cannot encode the response to request {uid}")]
    Encode {
        uid: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What was decided, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// At least one mount got HostToContainer.
    Patched,
    /// Nothing to change.
    Unchanged,
    /// Nothing changed, and some volume's driver was not known.
    Unresolved,
    /// The pod carries the opt-out annotation.
    OptedOut,
    /// Not a request this webhook changes (not a Pod CREATE or an
    /// ephemeral-container update).
    Skipped,
}

impl Outcome {
    /// The `result` label of the admissions metric.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Patched => "patched",
            Outcome::Unchanged => "unchanged",
            Outcome::Unresolved => "unresolved",
            Outcome::OptedOut => "opted_out",
            Outcome::Skipped => "skipped",
        }
    }
}

/// A review answered.
#[derive(Debug)]
pub struct Reviewed {
    pub uid: String,
    pub namespace: String,
    /// The pod's name, or its `generateName` prefix on CREATE.
    pub pod: String,
    pub outcome: Outcome,
    pub plan: Plan,
    /// The AdmissionReview to send back.
    pub response: Vec<u8>,
}

/// The AdmissionReview sent back. Not kube's `AdmissionResponse`: kube-core
/// 5 writes its `patch` as a JSON array of numbers (kube-rs issue 1781),
/// four times the size of the base64 the API documents for a `[]byte`, and
/// encoding that array was half the time of a whole review.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Answer<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: AnswerResponse<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AnswerResponse<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    /// Base64 on the wire.
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<ByteString>,
}

/// Answers one AdmissionReview (the request body).
pub fn review(body: &[u8], selection: &Selection, cache: &VolumeCache) -> Result<Reviewed, ReviewError> {
    // Tracking the path costs an allocation per key: only done again, to
    // name where it broke, for a review that does not decode.
    let review: AdmissionReview<Pod> = serde_json::from_slice(body).map_err(|_| malformed(body))?;
    if review.types.kind != admission::META_KIND || review.types.api_version != admission::META_API_VERSION_V1 {
        return Err(ReviewError::WrongType {
            kind: review.types.kind,
            api_version: review.types.api_version,
            expected: admission::META_API_VERSION_V1,
        });
    }
    let request: AdmissionRequest<Pod> = review.try_into().map_err(|_| ReviewError::NoRequest)?;
    let namespace = request.namespace.clone().unwrap_or_default();
    let pod = request.object.as_ref().map_or_else(String::new, |pod| {
        pod.metadata.name.clone().or_else(|| pod.metadata.generate_name.clone()).unwrap_or_default()
    });

    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    let scope = match (&request.operation, request.sub_resource.as_deref(), &request.old_object) {
        (Operation::Create, None, _) => Some(Scope::WholePod),
        (Operation::Update, Some("ephemeralcontainers"), Some(old)) => Some(Scope::NewEphemeral { old }),
        _ => None,
    };
    let (outcome, plan) = match (is_pod, scope, &request.object) {
        (true, Some(scope), Some(object)) => {
            let plan = policy::plan(object, &namespace, scope, selection, cache);
            let outcome = if plan.opted_out {
                Outcome::OptedOut
            } else if !plan.changes.is_empty() {
                Outcome::Patched
            } else if !plan.unresolved.is_empty() {
                Outcome::Unresolved
            } else {
                Outcome::Unchanged
            };
            (outcome, plan)
        }
        _ => (Outcome::Skipped, Plan::default()),
    };

    let patch = if plan.changes.is_empty() {
        None
    } else {
        let operations = plan
            .changes
            .iter()
            .map(|change| PatchOperation::Add(AddOperation { path: change.pointer(), value: HOST_TO_CONTAINER.into() }))
            .collect();
        let patch = serde_json::to_vec(&Patch(operations))
            .map_err(|err| ReviewError::Encode { uid: request.uid.clone(), source: err.into() })?;
        Some(ByteString(patch))
    };
    let answer = Answer {
        api_version: admission::META_API_VERSION_V1,
        kind: admission::META_KIND,
        response: AnswerResponse {
            uid: &request.uid,
            allowed: true,
            patch_type: patch.as_ref().map(|_| "JSONPatch"),
            patch,
        },
    };
    // Room for the base64 patch and the rest, so the buffer never regrows.
    let mut response =
        Vec::with_capacity(256 + answer.response.patch.as_ref().map_or(0, |patch| patch.0.len() * 4 / 3));
    serde_json::to_writer(&mut response, &answer)
        .map_err(|err| ReviewError::Encode { uid: request.uid.clone(), source: err.into() })?;
    Ok(Reviewed { uid: request.uid, namespace, pod, outcome, plan, response })
}

/// Why `body` does not decode, and where.
fn malformed(body: &[u8]) -> ReviewError {
    let deserializer = &mut serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, AdmissionReview<Pod>>(deserializer) {
        Err(err) => ReviewError::Malformed { path: err.path().to_string(), source: err.into_inner() },
        // Cannot happen (the same bytes, the same type); say so rather than panic.
        Ok(_) => ReviewError::Malformed {
            path: ".".to_owned(),
            source: serde::de::Error::custom("decoding failed once and succeeded when repeated"),
        },
    }
}

/// The body of an HTTP 400 answer: a `meta/v1` Status, which the API
/// server's client decodes and puts in its error and log line.
pub fn status_body(message: &str) -> Vec<u8> {
    serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("fuse-supervisor webhook: {message}"),
        "reason": "BadRequest",
        "code": 400,
    })
    .to_string()
    .into_bytes()
}
