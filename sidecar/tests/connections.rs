//! What a client connection may hold before it is authenticated: a bounded time to send its
//! headers (--header-timeout-ms) and a bounded number of connections (--max-connections).

mod support;

use std::time::{Duration, Instant};

use support::Sidecar;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr(s: &Sidecar) -> String {
    s.base.trim_start_matches("http://").to_string()
}

/// Reads until the peer closes the connection (bounded: a never-closed connection fails the
/// test); returns what was read.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(20), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the sidecar kept the connection open"),
        }
    }
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let sidecar = Sidecar::start(&["--header-timeout-ms", "300"]).await;
    let mut slow = TcpStream::connect(addr(&sidecar)).await.unwrap();
    slow.write_all(b"POST /v1/decide HTTP/1.1\r\nhost: x\r\ncontent-")
        .await
        .unwrap();
    let started = Instant::now();
    let got = read_until_closed(&mut slow).await;
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "closed for its headers' time, not at once"
    );
    assert!(
        got.is_empty() || String::from_utf8_lossy(&got).starts_with("HTTP/1.1 408"),
        "nothing but a timeout: {}",
        String::from_utf8_lossy(&got)
    );
    // A client that sends its request in time is served as usual.
    let (status, _) = sidecar.get("/healthz").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn past_max_connections_a_new_connection_is_closed_until_one_ends() {
    // The readiness check's client keeps its connection in a pool: the header timeout closes it
    // after 3 s idle, and then this test takes the one slot.
    let sidecar = Sidecar::start(&["--max-connections", "1", "--header-timeout-ms", "3000"]).await;
    let held = {
        let mut tries = 0;
        loop {
            let mut c = TcpStream::connect(addr(&sidecar)).await.unwrap();
            c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 64];
            match tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => break c,
                _ => {
                    tries += 1;
                    assert!(tries < 400, "never got the one connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    let mut second = TcpStream::connect(addr(&sidecar)).await.unwrap();
    let _ = second
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let got = read_until_closed(&mut second).await;
    assert!(got.is_empty(), "refused without an answer: {got:?}");
    drop(held);
    // The slot is free again once the first connection ends.
    let started = Instant::now();
    loop {
        let mut c = TcpStream::connect(addr(&sidecar)).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let got = read_until_closed(&mut c).await;
        if String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
