//! Offset-token paging for ListVolumes and ListSnapshots. A backend sorts what it lists; the
//! token is the index of the next entry as a decimal number, so a page needs no state. An
//! entry created or deleted between two pages shifts the rest by one: CSI allows that (a
//! listing is no snapshot of the store).
use crate::types::Error;

/// One page of `all`: at most `max_entries` (0 = no limit) from `starting_token` (empty = the
/// start), and the token of the next page (empty = this is the last). A token that is not a
/// number or points past the end is `aborted`, CSI's code for an invalid starting token.
///
/// ```
/// use wasmcsi_backend_sdk::page::page;
/// let names: Vec<u32> = (0..5).collect();
/// assert_eq!(page(names.clone(), 2, "").unwrap(), (vec![0, 1], "2".to_string()));
/// assert_eq!(page(names.clone(), 2, "4").unwrap(), (vec![4], String::new()));
/// assert!(page(names, 2, "six").is_err());
/// ```
pub fn page<T>(all: Vec<T>, max_entries: u32, starting_token: &str) -> Result<(Vec<T>, String), Error> {
    let start: usize = if starting_token.is_empty() {
        0
    } else {
        starting_token.parse().map_err(|_| Error::Aborted(format!("invalid starting token {starting_token:?}")))?
    };
    if start > all.len() {
        return Err(Error::Aborted(format!("starting token {starting_token} is past the end")));
    }
    let end = if max_entries == 0 { all.len() } else { all.len().min(start.saturating_add(max_entries as usize)) };
    let next = if end < all.len() { end.to_string() } else { String::new() };
    Ok((all.into_iter().skip(start).take(end - start).collect(), next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_cover_every_entry_once_in_order() {
        let all: Vec<u32> = (0..10).collect();
        let (mut seen, mut token) = (Vec::new(), String::new());
        loop {
            let (entries, next) = page(all.clone(), 3, &token).expect("valid token");
            assert!(entries.len() <= 3);
            seen.extend(entries);
            if next.is_empty() {
                break;
            }
            token = next;
        }
        assert_eq!(seen, all);
    }

    #[test]
    fn zero_means_everything_and_bad_tokens_are_aborted() {
        assert_eq!(page(vec![1, 2, 3], 0, ""), Ok((vec![1, 2, 3], String::new())));
        assert_eq!(page(vec![1, 2, 3], 0, "3"), Ok((vec![], String::new())), "the end itself is a valid token");
        for bad in ["x", "-1", "4", "1.5"] {
            assert!(matches!(page(vec![1, 2, 3], 1, bad), Err(Error::Aborted(_))), "{bad}");
        }
        assert_eq!(page(vec![1, 2, 3], u32::MAX, "1"), Ok((vec![2, 3], String::new())));
    }
}
