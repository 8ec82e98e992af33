//! The pieces `make scale` stands on, checked for what they must do (nothing about timing): a
//! Cluster of N primaries joined by hand serves every slot from the node `even_slot_ranges` names,
//! and network namespaces carry traffic over a veth pair and through a delay relay, then vanish
//! with what ran inside them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use ratelimit_e2e::netns::{self, DelayRelay, Netns};
use ratelimit_e2e::redis::even_slot_ranges;
use ratelimit_e2e::{wait_until, RedisCluster, READY_TIMEOUT};

/// A key of the slot `slot` (its hash tag found by CRC16, checked by the server).
fn key_in_slot(cluster: &RedisCluster, slot: u16) -> String {
    let key = (0u64..)
        .map(|i| format!("k{{{i}}}"))
        .find(|k| {
            let tag = &k[2..k.len() - 1];
            crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16384 == slot
        })
        .expect("some tag hashes to every slot");
    assert_eq!(
        cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &key]),
        slot.to_string()
    );
    key
}

#[test]
fn two_primaries_joined_by_hand_serve_every_slot_from_the_named_node() {
    let cluster = RedisCluster::start_primaries(2);
    let ranges = even_slot_ranges(2);
    assert_eq!(ranges, vec![(0, 8191), (8192, 16383)]);
    for (node, (first, last)) in cluster.nodes.iter().zip(&ranges) {
        let info = node.cli(&["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_slots_ok:16384"), "{info}");
        assert!(info.contains("cluster_known_nodes:2"), "{info}");
        // CLUSTER SHARDS would be nicer; CLUSTER NODES names each node's own slots on its line.
        let mine = node
            .cli(&["CLUSTER", "NODES"])
            .lines()
            .find(|l| l.contains("myself"))
            .expect("a myself line")
            .to_string();
        assert!(mine.ends_with(&format!("{first}-{last}")), "{mine}");
    }
    // A write through a Cluster client lands on the node serving its slot.
    let mut client = cluster.client();
    for (i, (first, last)) in ranges.iter().enumerate() {
        let key = key_in_slot(&cluster, (first + last) / 2);
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(i)
            .query(&mut client)
            .expect("SET through the cluster client");
        assert_eq!(cluster.nodes[i].cli(&["DBSIZE"]), "1", "{key} on node {i}");
    }
}

#[test]
fn one_primary_serves_all_16384_slots() {
    let cluster = RedisCluster::start_primaries(1);
    let info = cluster.nodes[0].cli(&["CLUSTER", "INFO"]);
    assert!(info.contains("cluster_state:ok"), "{info}");
    assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
    assert_eq!(even_slot_ranges(1), vec![(0, 16383)]);
}

/// An echo server on `addr`, inside the calling thread's namespace.
fn echo(addr: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind(addr).expect("bind the echo server");
    let bound = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    bound
}

fn round_trip(addr: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(payload).expect("write");
    let mut back = vec![0u8; payload.len()];
    s.read_exact(&mut back).expect("read the echo");
    back
}

#[test]
fn namespaces_carry_traffic_over_a_veth_and_a_delay_relay_then_vanish_with_their_processes() {
    let (a, b) = (Netns::create("test-a"), Netns::create("test-b"));
    let names = (a.name.clone(), b.name.clone());
    assert!(netns::exists(&names.0) && netns::exists(&names.1));
    netns::link(&a, "a0", "10.88.0.1/24", &b, "b0", "10.88.0.2/24");
    let server = b.run(|| echo("10.88.0.2:7000".parse().unwrap()));
    let relay = DelayRelay::start(&b, "10.88.0.2:7001".parse().unwrap(), server);
    let payload: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    // From the other namespace: straight, through the relay at 0, and with a delay.
    assert_eq!(a.run(|| round_trip(server, &payload)), payload);
    assert_eq!(a.run(|| round_trip(relay.addr, &payload)), payload);
    relay.set_round_trip(Duration::from_millis(2));
    assert_eq!(a.run(|| round_trip(relay.addr, &payload)), payload);
    let (_, _, writes) = relay.lateness();
    assert!(writes >= 2, "the relay wrote {writes} chunks");
    // The link is theirs: this namespace has no such device.
    let here = std::process::Command::new("ip")
        .args(["link", "show", "a0"])
        .output()
        .expect("ip link");
    assert!(
        !here.status.success(),
        "a0 is visible outside its namespace"
    );

    let mut sleeper = b.command("sleep").arg("600").spawn().expect("spawn in b");
    // `ip netns exec` enters the namespace, then execs: the pid is the sleeper's.
    wait_until("the sleeper in b", READY_TIMEOUT, || {
        b.pids().contains(&sleeper.id())
    });
    drop(relay);
    drop(a);
    drop(b);
    assert!(!netns::exists(&names.0) && !netns::exists(&names.1));
    // Killed when its namespace went.
    let status = sleeper.wait().expect("reap");
    assert!(!status.success());
}
