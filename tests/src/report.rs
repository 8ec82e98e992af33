//! What the measuring binaries (`make bench`, `make scale`, `make reliability`) print with:
//! fixed-width tables, markdown tables, quantiles and medians, and the two ways they write a
//! duration.

use std::time::Duration;

/// The value at quantile `q` (0 to 1) of `sorted` (ascending): the element at `len × q`, the
/// last one for `q` = 1; zero when there is none.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    match sorted.len() {
        0 => Duration::ZERO,
        n => sorted[((n as f64 * q) as usize).min(n - 1)],
    }
}

/// The median of `values` (the mean of the middle two for an even count, 0 for none).
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.into_iter().collect();
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// A duration in the unit that suits it: `12.3ms`, `1.23ms`, `456µs`.
pub fn short(d: Duration) -> String {
    if d >= Duration::from_millis(10) {
        format!("{:.1}ms", d.as_secs_f64() * 1e3)
    } else if d >= Duration::from_millis(1) {
        format!("{:.2}ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.0}µs", d.as_secs_f64() * 1e6)
    }
}

/// A duration in milliseconds: `4.2 ms` below 10 ms, `37 ms` from there.
pub fn ms(d: Duration) -> String {
    let v = d.as_secs_f64() * 1000.0;
    if v < 10.0 {
        format!("{v:.1} ms")
    } else {
        format!("{v:.0} ms")
    }
}

/// One column of a [`Table`].
#[derive(Clone, Copy, Debug)]
struct Column {
    width: usize,
    left: bool,
    /// Spaces before the column (none before the first).
    gap: usize,
}

/// A table of fixed-width columns, each padded to its width (never cut) and aligned left or
/// right, one space between columns unless [`Table::gap`] says more. Widths count characters,
/// as `format!` pads.
#[derive(Clone, Debug, Default)]
pub struct Table {
    columns: Vec<Column>,
    next_gap: usize,
}

impl Table {
    pub fn new() -> Table {
        Table {
            columns: Vec::new(),
            next_gap: 1,
        }
    }

    fn column(mut self, width: usize, left: bool) -> Table {
        let gap = if self.columns.is_empty() {
            0
        } else {
            self.next_gap
        };
        self.columns.push(Column { width, left, gap });
        self.next_gap = 1;
        self
    }

    /// A column whose cells are padded on the right to `width`.
    pub fn left(self, width: usize) -> Table {
        self.column(width, true)
    }

    /// A column whose cells are padded on the left to `width`.
    pub fn right(self, width: usize) -> Table {
        self.column(width, false)
    }

    /// Columns padded on the left to each of `widths`, one space apart.
    pub fn rights(self, widths: &[usize]) -> Table {
        widths.iter().fold(self, |t, w| t.right(*w))
    }

    /// The next column starts after `spaces` spaces instead of one.
    pub fn gap(mut self, spaces: usize) -> Table {
        self.next_gap = spaces;
        self
    }

    /// One line of the table. Cells beyond the columns follow as they are, one space apart.
    pub fn line<S: AsRef<str>>(&self, cells: &[S]) -> String {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let cell = cell.as_ref();
            match self.columns.get(i) {
                Some(c) => {
                    out.push_str(&" ".repeat(c.gap));
                    if c.left {
                        out.push_str(&format!("{cell:<w$}", w = c.width));
                    } else {
                        out.push_str(&format!("{cell:>w$}", w = c.width));
                    }
                }
                None => {
                    if i > 0 {
                        out.push(' ');
                    }
                    out.push_str(cell);
                }
            }
        }
        out
    }

    /// `text` where the second column starts, the first left blank: a note under a row.
    pub fn note(&self, text: &str) -> String {
        let first = self.columns.first().map_or(0, |c| c.width);
        let gap = self.columns.get(1).map_or(1, |c| c.gap);
        format!("{}{}{text}", " ".repeat(first), " ".repeat(gap))
    }
}

/// A markdown table: the header, its rule, then one line per row. An empty cell shows `—`; a
/// `|` in a cell becomes `/` and a line break a space, so a cell never breaks the table.
pub fn markdown<R: AsRef<[String]>>(header: &[&str], rows: &[R]) -> String {
    let clean = |s: &str| s.replace('|', "/").replace('\n', " ");
    let mut out = format!("| {} |\n", header.join(" | "));
    out += &format!("|{}\n", " --- |".repeat(header.len()));
    for row in rows {
        let cells: Vec<String> = row
            .as_ref()
            .iter()
            .map(|c| if c.is_empty() { "—".into() } else { clean(c) })
            .collect();
        out += &format!("| {} |\n", cells.join(" | "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms_list(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|m| Duration::from_millis(*m)).collect()
    }

    #[test]
    fn quantiles_pick_the_element_at_len_times_q_and_the_last_for_one() {
        let sorted = ms_list(&(1..=100).collect::<Vec<_>>());
        assert_eq!(quantile(&sorted, 0.5), Duration::from_millis(51));
        assert_eq!(quantile(&sorted, 0.99), Duration::from_millis(100));
        assert_eq!(quantile(&sorted, 1.0), Duration::from_millis(100));
        assert_eq!(quantile(&sorted, 0.0), Duration::from_millis(1));
        assert_eq!(quantile(&ms_list(&[7]), 0.99), Duration::from_millis(7));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn medians_take_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median([5.0]), 5.0);
        assert_eq!(median(Vec::<f64>::new()), 0.0);
        assert_eq!(median([f64::NAN, 1.0, 2.0]), 2.0, "NaN sorts last");
    }

    #[test]
    fn durations_are_written_in_the_unit_that_suits_them() {
        assert_eq!(short(Duration::from_micros(456)), "456µs");
        assert_eq!(short(Duration::from_micros(1234)), "1.23ms");
        assert_eq!(short(Duration::from_micros(12_345)), "12.3ms");
        assert_eq!(ms(Duration::from_micros(4_240)), "4.2 ms");
        assert_eq!(ms(Duration::from_micros(37_400)), "37 ms");
    }

    #[test]
    fn table_lines_pad_each_cell_as_format_does() {
        let t = Table::new().left(6).right(4).gap(2).rights(&[5]).left(3);
        let line = t.line(&["ab", "1", "µs/op", "x"]);
        assert_eq!(
            line,
            format!("{:<6} {:>4}  {:>5} {:<3}", "ab", "1", "µs/op", "x")
        );
        assert_eq!(line, "ab        1  µs/op x  ");
        // Never cut; cells past the columns follow one space apart.
        assert_eq!(
            t.line(&["abcdefgh", "12345", "", "", "extra"]),
            "abcdefgh 12345            extra"
        );
        assert_eq!(t.note("below"), "       below");
    }

    #[test]
    fn markdown_tables_fill_empty_cells_and_keep_cells_in_one_line() {
        let rows = vec![
            vec!["a".to_string(), String::new()],
            vec!["x | y".to_string(), "two\nlines".to_string()],
        ];
        assert_eq!(
            markdown(&["name", "value"], &rows),
            "| name | value |\n| --- | --- |\n| a | — |\n| x / y | two lines |\n"
        );
    }
}
