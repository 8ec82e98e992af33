//! The regional shares in Redis ([`ShareStore`]): a rule's share record read (with the `run_id`
//! of the process that answered) and its demand counters added to.

use super::RedisStore;
use crate::keys::{demand_key, share_key};
use crate::regional::record;
use crate::store::{ShareRead, ShareStore, StoreError};

impl ShareStore for RedisStore {
    async fn read_share(&self, domain: &str, rule: &str) -> Result<ShareRead, StoreError> {
        let key = share_key(&self.inner.options.key_prefix, domain, rule);
        let v = self.bounded(self.query(record::read_cmd(&key))).await?;
        let (fields, answered_by) =
            record::parse_read(v).map_err(|e| StoreError::Reply(format!("{key}: {e}")))?;
        let record =
            record::parse(&fields).map_err(|e| StoreError::Reply(format!("{key}: {e}")))?;
        Ok(ShareRead {
            record,
            answered_by,
        })
    }

    async fn add_demand(
        &self,
        domain: &str,
        rule: &str,
        admitted: u64,
        rejected: u64,
    ) -> Result<(), StoreError> {
        let key = demand_key(&self.inner.options.key_prefix, domain, rule);
        let counters = [(record::ADMITTED, admitted), (record::REJECTED, rejected)];
        for (field, n) in counters.into_iter().filter(|(_, n)| *n > 0) {
            let mut cmd = redis::cmd("HINCRBY");
            cmd.arg(&key).arg(field).arg(n);
            self.bounded(self.query(cmd)).await?;
        }
        Ok(())
    }
}
