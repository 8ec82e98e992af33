//! A Redis Cluster of primaries started by a test, joined by hand.

use super::*;

/// Three cluster-enabled primaries joined by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

impl RedisCluster {
    pub fn start() -> Self {
        RedisCluster::start_with_options(&RedisOptions::default())
    }

    /// Every node started with `options` (with TLS, the cluster bus uses TLS too).
    pub fn start_with_options(options: &RedisOptions) -> Self {
        let mut options = options.clone().args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]);
        if options.tls.is_some() {
            options = options.args(&["--tls-cluster", "yes"]);
        }
        let nodes: Vec<Redis> = (0..3)
            .map(|_| Redis::start_with_options(&options))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(options.cli_args())
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for n in &nodes {
            wait_until("cluster_state:ok", Duration::from_secs(30), || {
                n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
        }
        Self { nodes }
    }

    /// Three primaries, each with one replica (`--cluster-replicas 1`): six nodes in `nodes`.
    /// A primary unreachable for `node_timeout_ms` is failed over to its replica. With
    /// `cluster-require-full-coverage no`, the other primaries keep serving their slots meanwhile
    /// (with the default `yes`, every slot stops until the promotion). Returns once every node
    /// says `cluster_state:ok` and every replica's link to its primary is up.
    pub fn start_replicated(node_timeout_ms: u64) -> Self {
        let timeout = node_timeout_ms.to_string();
        let options = RedisOptions::default().args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &timeout,
            "--cluster-require-full-coverage",
            "no",
        ]);
        let nodes: Vec<Redis> = (0..6)
            .map(|_| Redis::start_with_options(&options))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        for n in &cluster.nodes {
            wait_until("cluster_state:ok", Duration::from_secs(30), || {
                n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
        }
        for i in 0..cluster.nodes.len() {
            if cluster.primary_port_of_replica(i).is_some() {
                cluster.nodes[i].wait_linked();
            }
        }
        cluster
    }

    /// The index in `nodes` of the primary that serves `key` now (the others answer MOVED; a
    /// stopped node answers nothing).
    pub fn primary_of(&self, key: &str) -> Option<usize> {
        self.nodes.iter().position(|n| {
            let out = n.cli(&["EXISTS", key]);
            out == "0" || out == "1"
        })
    }

    /// The port of the primary node `i` replicates, if it is a replica (`INFO replication`).
    pub fn primary_port_of_replica(&self, i: usize) -> Option<u16> {
        let info = self.nodes[i].cli(&["INFO", "replication"]);
        if !info.contains("role:slave") {
            return None;
        }
        info.lines()
            .find_map(|l| l.trim().strip_prefix("master_port:"))
            .and_then(|p| p.trim().parse().ok())
    }

    /// The index of a replica of the primary `primary` (by index), if it has one.
    pub fn replica_of(&self, primary: usize) -> Option<usize> {
        let port = self.nodes[primary].port;
        (0..self.nodes.len()).find(|&i| self.primary_port_of_replica(i) == Some(port))
    }

    /// The nodes' URLs, comma-separated (the sidecar's `--redis-cluster`).
    pub fn seeds(&self) -> String {
        self.nodes
            .iter()
            .map(Redis::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn client(&self) -> redis::cluster::ClusterConnection {
        let urls: Vec<String> = self.nodes.iter().map(Redis::url_with_password).collect();
        let mut builder = redis::cluster::ClusterClientBuilder::new(urls);
        if let Some(pki) = &self.nodes[0].options.tls {
            builder = builder.certs(pki.redis_certificates());
        }
        builder
            .build()
            .and_then(|c| c.get_connection())
            .expect("cluster connection")
    }
}

/// Which of the nodes on `ports` serves `key` now (answers it rather than MOVED; one that
/// does not answer is passed over, one that is paused holds the question until it resumes).
pub fn node_serving(ports: &[u16], key: &str) -> Option<u16> {
    ports.iter().copied().find(|&port| {
        let out = cli_with(port, &[], &["EXISTS", key]);
        out == "0" || out == "1"
    })
}

/// The slots of a Cluster of `n` primaries split evenly, in order: primary `i` serves
/// `16384 * i / n ..= 16384 * (i + 1) / n - 1`.
pub fn even_slot_ranges(n: usize) -> Vec<(u16, u16)> {
    assert!(n >= 1, "a Cluster has at least one primary");
    (0..n)
        .map(|i| ((16384 * i / n) as u16, (16384 * (i + 1) / n - 1) as u16))
        .collect()
}

impl RedisCluster {
    /// `n` cluster-enabled primaries (1 or more, no replicas), primary `i` serving
    /// [`even_slot_ranges`]`(n)[i]`, joined by hand: `CLUSTER ADDSLOTSRANGE`,
    /// `CLUSTER SET-CONFIG-EPOCH` and `CLUSTER MEET` (`redis-cli --cluster create` wants at least
    /// three). Returns once every node sees all `n` nodes and all 16384 slots served.
    pub fn start_primaries(n: usize) -> Self {
        RedisCluster::start_primaries_with_options(n, &RedisOptions::default())
    }

    /// [`RedisCluster::start_primaries`] with every node started with `options`.
    pub fn start_primaries_with_options(n: usize, options: &RedisOptions) -> Self {
        let ranges = even_slot_ranges(n);
        let mut options = options.clone().args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]);
        if options.tls.is_some() {
            options = options.args(&["--tls-cluster", "yes"]);
        }
        let nodes: Vec<Redis> = (0..n)
            .map(|_| Redis::start_with_options(&options))
            .collect();
        for (i, (node, (first, last))) in nodes.iter().zip(&ranges).enumerate() {
            let (first, last, epoch) = (first.to_string(), last.to_string(), (i + 1).to_string());
            for cmd in [
                &["CLUSTER", "ADDSLOTSRANGE", &first, &last][..],
                &["CLUSTER", "SET-CONFIG-EPOCH", &epoch][..],
            ] {
                let out = node.cli(cmd);
                assert_eq!(out, "OK", "{cmd:?} on node {}: {out}", node.port);
            }
        }
        for node in &nodes[1..] {
            let out = nodes[0].cli(&["CLUSTER", "MEET", "127.0.0.1", &node.port.to_string()]);
            assert_eq!(out, "OK", "CLUSTER MEET {}: {out}", node.port);
        }
        let known = format!("cluster_known_nodes:{n}");
        for node in &nodes {
            wait_until(
                &format!("node {} to see {n} nodes and every slot", node.port),
                Duration::from_secs(30),
                || {
                    let info = node.cli(&["CLUSTER", "INFO"]);
                    ["cluster_state:ok", "cluster_slots_ok:16384", &known]
                        .iter()
                        .all(|want| info.lines().any(|l| l.trim() == *want))
                },
            );
        }
        RedisCluster { nodes }
    }
}
