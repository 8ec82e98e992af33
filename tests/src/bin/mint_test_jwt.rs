//! Prints a JWT for the JWT example (`make run ENVOY_CONFIG=envoy/envoy-jwt.yaml`), signed with the
//! TEST key whose public half is `envoy/jwt/jwks.json`. For trying the example only.
//!
//!     cargo run -q -p ratelimit-e2e --bin mint-test-jwt -- --sub alice --tenant acme

use clap::Parser;

#[derive(Parser)]
#[command(about = "Prints a JWT signed with the test key of the JWT example")]
struct Args {
    /// The `sub` claim (the user).
    #[arg(long, default_value = "alice")]
    sub: String,
    /// The `tenant` claim.
    #[arg(long, default_value = "acme")]
    tenant: String,
}

fn main() {
    let args = Args::parse();
    let claims = serde_json::json!({
        "iss": ratelimit_e2e::JWT_ISSUER,
        "sub": args.sub,
        "tenant": args.tenant,
    });
    println!("{}", ratelimit_e2e::signed_jwt(&claims));
}
