//! The stream per worker's service, in-process over a real HTTP/2 connection (tonic's client
//! against the router on a loopback listener, a `MemoryStore` behind): every call is answered
//! with its own id and the status and body its HTTP endpoint gives; a malformed call or one of an
//! unknown kind gets a 400 of its own and the stream carries on; a message over
//! `--max-body-bytes` ends the stream; when the sidecar begins to stop, the stream ends.

mod support;

use axum::http::uri::PathAndQuery;
use prost::Message;
use ratelimit_sidecar::calls::Stopping;
use ratelimit_sidecar::http::router;
use ratelimit_wire::stream::{Answer, Call, Kind, STREAM_PATH};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::Streaming;
use tonic_prost::ProstCodec;

const MAX_BODY_BYTES: usize = 4096;

/// The router on a loopback listener, and the sender of its "stopping" signal.
async fn serve() -> (String, tokio::sync::watch::Sender<bool>) {
    let (stop, stopping) = Stopping::new();
    let (state, _) = support::memory_state(
        "rules: {per-app: {capacity: 2, refill_per_sec: 0.001}}",
        stopping,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(state, MAX_BODY_BYTES);
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), stop)
}

/// Opens a stream: the sender of its calls and its answers.
async fn open(url: &str) -> (mpsc::Sender<Call>, Streaming<Answer>) {
    let channel = Channel::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let (tx, rx) = mpsc::channel::<Call>(16);
    let calls =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let answers = grpc
        .streaming(
            tonic::Request::new(calls),
            PathAndQuery::from_static(STREAM_PATH),
            ProstCodec::<Call, Answer>::default(),
        )
        .await
        .expect("the stream opens")
        .into_inner();
    (tx, answers)
}

fn call(id: u32, kind: Kind, body: Value) -> Call {
    Call {
        id,
        kind: kind as i32,
        body: if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        },
    }
}

fn decide(app: &str) -> Value {
    json!({"requests": [{"decisions": [{"rule": "per-app", "subject": {"app": app}}]}]})
}

async fn next(answers: &mut Streaming<Answer>) -> (u32, u32, Value) {
    let a = answers
        .message()
        .await
        .expect("no error")
        .expect("an answer");
    let body = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
    (a.id, a.status, body)
}

#[tokio::test]
async fn every_call_gets_its_own_answer_and_a_bad_call_leaves_the_stream_open() {
    let (url, _stop) = serve().await;
    let (tx, mut answers) = open(&url).await;
    // Three decisions of one app with a bucket of 2: admitted, admitted, rejected.
    for id in [7, 8, 9] {
        tx.send(call(id, Kind::Decide, decide("a"))).await.unwrap();
        let (got, status, body) = next(&mut answers).await;
        assert_eq!((got, status), (id, 200));
        assert_eq!(body["answers"][0]["allowed"], json!(id != 9), "{body}");
    }
    tx.send(call(10, Kind::Epoch, Value::Null)).await.unwrap();
    let (id, status, body) = next(&mut answers).await;
    assert_eq!((id, status), (10, 200));
    assert!(body["epoch"].is_u64(), "{body}");
    let release = json!({"release": [{"rule": "per-app", "subject": {"app": "a"}, "slot": "s1"}]});
    tx.send(call(11, Kind::Slots, release)).await.unwrap();
    let (id, status, body) = next(&mut answers).await;
    assert_eq!((id, status), (11, 200));
    assert_eq!(body["unknown"], 1, "a slot never taken: {body}");
    let settle = json!({"settlements": [{"rule": "per-app", "subject": {"app": "b"},
                                         "reserved": 1, "cost": 1}]});
    tx.send(call(15, Kind::Settle, settle)).await.unwrap();
    let (id, status, body) = next(&mut answers).await;
    assert_eq!((id, status), (15, 200), "{body}");
    // A malformed body, and a kind this sidecar does not know: a 400 each, and the stream
    // carries on.
    tx.send(Call {
        id: 12,
        kind: Kind::Decide as i32,
        body: b"{not json".to_vec(),
    })
    .await
    .unwrap();
    let (id, status, body) = next(&mut answers).await;
    assert_eq!((id, status), (12, 400));
    assert!(body["error"].is_string(), "{body}");
    tx.send(Call {
        id: 13,
        kind: 42,
        body: Vec::new(),
    })
    .await
    .unwrap();
    let (id, status, body) = next(&mut answers).await;
    assert_eq!((id, status), (13, 400));
    assert!(body["error"].as_str().unwrap().contains("42"), "{body}");
    tx.send(call(14, Kind::Decide, decide("b"))).await.unwrap();
    assert_eq!(next(&mut answers).await.1, 200);
}

#[tokio::test]
async fn a_message_over_the_body_limit_ends_the_stream() {
    let (url, _stop) = serve().await;
    let (tx, mut answers) = open(&url).await;
    let huge = Call {
        id: 1,
        kind: Kind::Decide as i32,
        body: vec![b' '; MAX_BODY_BYTES + 100],
    };
    assert!(huge.encoded_len() > MAX_BODY_BYTES + 32);
    tx.send(huge).await.unwrap();
    let status = answers
        .message()
        .await
        .expect_err("the stream ends in an error");
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
}

#[tokio::test]
async fn a_stopping_sidecar_ends_the_stream_once_its_calls_are_answered() {
    let (url, stop) = serve().await;
    let (tx, mut answers) = open(&url).await;
    tx.send(call(1, Kind::Decide, decide("a"))).await.unwrap();
    assert_eq!(next(&mut answers).await.0, 1);
    stop.send(true).unwrap();
    assert!(
        answers.message().await.expect("ends cleanly").is_none(),
        "the stream ends"
    );
}
