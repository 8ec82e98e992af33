//! After the verdict: the response's metered costs, their settlements, and what was delivered.

use super::*;

impl Flow<'_> {
    /// The charged decisions of an admitted request whose real cost its response reports: one
    /// [`Meter`] each, for the host to feed the response to ([`Flow::settled`] at its end).
    pub fn metered(&self, w: &Waiting) -> Vec<Metered> {
        w.charged
            .iter()
            .filter_map(|(i, receipt)| {
                let p = &w.planned[*i];
                let spec = self.config.rules[p.rule].cost.settled()?;
                Some(Metered {
                    rule: p.rule,
                    subject: p.subject.clone(),
                    reserved: p.cost,
                    receipt: receipt.clone(),
                    meter: Meter::new(spec),
                })
            })
            .collect()
    }

    /// A metered decision's response is over (`complete`: its body ended, not cut short): the
    /// settlement to send, if the real cost differs from the reservation. A response whose cost
    /// cannot be read (not reported, compressed, cut short) settles at the rule's
    /// `unreported_cost`, never at what the client chose ([`costs::CostSpec::unreported`]).
    pub fn settled(
        &self,
        mut m: Metered,
        complete: bool,
        budget: &mut costs::Budget,
    ) -> Option<costs::Settlement> {
        let spec = self.config.rules[m.rule].cost.settled()?;
        let cost = match m.meter.finish(complete, budget) {
            Some(cost) => cost,
            None => {
                self.stats.count(Stat::CostsUnreported);
                spec.unreported(config::MAX_CAPACITY)
            }
        };
        let cost = cost.min(config::MAX_CAPACITY);
        if cost == m.reserved {
            return None;
        }
        self.stats.count(Stat::CostsSettled);
        Some(costs::Settlement {
            rule: self.config.rules[m.rule].name.clone(),
            subject: m.subject,
            reserved: m.reserved,
            cost,
            receipt: m.receipt,
        })
    }

    /// Counts what an outbox could not deliver.
    pub fn count_delivery(&self, d: costs::Delivery) {
        self.stats.add(Stat::SettlementsRetried, d.retried);
        self.stats.add(Stat::SettlementsLost, d.lost);
    }

    /// Counts what a slots call (or its failure) did.
    pub fn count_slots(&self, d: crate::slots::SlotDelivery) {
        self.stats.add(Stat::SlotsRenewed, d.renewed);
        self.stats.add(Stat::SlotsReleased, d.released);
        self.stats.add(Stat::SlotsExpired, d.expired);
        self.stats.add(Stat::SlotsRetried, d.retried);
        self.stats.add(Stat::SlotsLost, d.lost);
    }

    /// Counts a verdict the host carried out: the request admitted, or answered 429.
    pub fn delivered(&self, verdict: &Verdict) {
        match verdict {
            Verdict::Admit { .. } => self.stats.count(Stat::Admitted),
            Verdict::Reject(reply) if reply.status == 429 => self.stats.count(Stat::Rejected),
            Verdict::Reject(_) => {}
        }
    }
}
