//! Every scenario of the simulation, for a short simulated time, static and rebalanced: the
//! facts the design promises hold exactly.

use ratelimit_regions::sim::{run, scenarios, Mode, SimConfig};
use ratelimit_regions::Share;

fn short(seed: u64) -> SimConfig {
    SimConfig {
        seed,
        duration_ms: 120_000,
        ..SimConfig::default()
    }
}

#[test]
fn no_scenario_admits_more_than_the_global_bucket_and_shares_never_sum_above_one() {
    for seed in [1, 2] {
        let config = short(seed);
        for scenario in scenarios(config.duration_ms) {
            for mode in [Mode::Static, Mode::Rebalanced] {
                let r = run(&scenario, mode, &config).unwrap();
                let at = format!("{} {} seed {seed}: {r:?}", scenario.name, mode.name());
                assert!(r.offered > 0, "{at}");
                assert_eq!(r.over_admitted, 0, "{at}");
                assert!(r.max_share_sum_ppm <= u64::from(Share::PPM), "{at}");
                assert_eq!(r.unavailable, 0, "sidecars read their own store: {at}");
                if mode == Mode::Static {
                    assert_eq!(r.writes, 0, "{at}");
                }
            }
        }
    }
}

#[test]
fn the_failures_the_scenarios_promise_happen() {
    let config = short(1);
    let all = scenarios(config.duration_ms);
    let by_name = |name: &str| all.iter().find(|s| s.name == name).unwrap();

    let failed = run(by_name("failed steps"), Mode::Rebalanced, &config).unwrap();
    assert!(failed.failed_writes >= 3, "{failed:?}");
    assert_eq!(failed.over_admitted, 0);

    let cut_off = run(by_name("eu cut off"), Mode::Rebalanced, &config).unwrap();
    assert!(
        cut_off.writes > 0,
        "the others rebalanced around eu: {cut_off:?}"
    );
    assert_eq!(cut_off.over_admitted, 0);

    let step = run(by_name("step eu->us"), Mode::Rebalanced, &config).unwrap();
    assert!(step.writes > 0, "shares moved: {step:?}");
}

#[test]
fn a_seed_gives_the_same_figures() {
    let config = short(7);
    let scenario = &scenarios(config.duration_ms)[2];
    assert_eq!(
        run(scenario, Mode::Rebalanced, &config).unwrap(),
        run(scenario, Mode::Rebalanced, &config).unwrap()
    );
}

#[test]
fn a_floor_the_regions_cannot_all_hold_is_refused_by_name() {
    let config = SimConfig {
        floor: Share::from_ppm(400_000).unwrap(),
        ..short(1)
    };
    let err = run(&scenarios(config.duration_ms)[0], Mode::Static, &config).unwrap_err();
    assert!(
        err.to_string()
            .contains("rules.steady.region_floor: 0.4000 for 3 regions"),
        "{err}"
    );
}
