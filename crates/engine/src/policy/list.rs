//! Intrusive doubly linked lists over dense node indices, shared by the policies: a node is in
//! at most one of a fixed number of lists, and every array is allocated once at construction,
//! so moving a node costs a few stores and never allocates. Each list has a newest end (where
//! nodes are pushed) and an oldest end (where victims are looked for).
//!
//! 8 bytes per node with one list (two 4-byte links; an unlinked node is marked in its
//! `older` link), 9 with more (a byte naming the node's list).

/// No node: the end of a list.
const NIL: u32 = u32::MAX;
/// The `older` link of a node in no list. Node numbers stay below it.
const UNLINKED: u32 = u32::MAX - 1;
const NO_LIST: u8 = u8::MAX;

pub(crate) struct Lists {
    /// Towards the oldest end; `UNLINKED` for a node in no list.
    older: Vec<u32>,
    /// Towards the newest end.
    newer: Vec<u32>,
    /// The list a linked node is in (stale for an unlinked one). Empty when there is one
    /// list: a linked node is in it.
    owner: Vec<u8>,
    newest: Vec<u32>,
    oldest: Vec<u32>,
    len: Vec<u32>,
}

fn opt(n: u32) -> Option<u32> {
    (n != NIL).then_some(n)
}

impl Lists {
    /// `nodes` node indices `0..nodes` (at most `u32::MAX - 1`), `lists` lists (1 to 254).
    pub fn new(nodes: usize, lists: usize) -> Lists {
        assert!((1..usize::from(NO_LIST)).contains(&lists));
        debug_assert!(nodes <= UNLINKED as usize, "{nodes} nodes");
        let owners = if lists == 1 { 0 } else { nodes };
        Lists {
            older: vec![UNLINKED; nodes],
            newer: vec![NIL; nodes],
            owner: vec![NO_LIST; owners],
            newest: vec![NIL; lists],
            oldest: vec![NIL; lists],
            len: vec![0; lists],
        }
    }

    /// The list node `n` is in. Out-of-range nodes are in none.
    pub fn list_of(&self, n: u32) -> Option<usize> {
        match self.older.get(n as usize) {
            Some(&UNLINKED) | None => None,
            Some(_) => Some(self.owner.get(n as usize).map_or(0, |&l| usize::from(l))),
        }
    }

    fn set_owner(&mut self, n: u32, list: usize) {
        if let Some(owner) = self.owner.get_mut(n as usize) {
            *owner = list as u8;
        }
    }

    pub fn contains(&self, n: u32) -> bool {
        self.list_of(n).is_some()
    }

    pub fn len(&self, list: usize) -> u32 {
        self.len[list]
    }

    pub fn oldest(&self, list: usize) -> Option<u32> {
        opt(self.oldest[list])
    }

    /// The node just newer than `n` in its list.
    pub fn newer(&self, n: u32) -> Option<u32> {
        opt(self.newer[n as usize])
    }

    /// Pushes an unlinked node at the newest end of `list`.
    pub fn push_newest(&mut self, list: usize, n: u32) {
        debug_assert!(!self.contains(n), "node {n} already linked");
        let i = n as usize;
        let head = self.newest[list];
        self.older[i] = head;
        self.newer[i] = NIL;
        if head == NIL {
            self.oldest[list] = n;
        } else {
            self.newer[head as usize] = n;
        }
        self.newest[list] = n;
        self.set_owner(n, list);
        self.len[list] += 1;
    }

    /// Takes a node out of its list; false when it was in none.
    pub fn unlink(&mut self, n: u32) -> bool {
        let Some(list) = self.list_of(n) else {
            return false;
        };
        let i = n as usize;
        let (o, w) = (self.older[i], self.newer[i]);
        if o == NIL {
            self.oldest[list] = w;
        } else {
            self.newer[o as usize] = w;
        }
        if w == NIL {
            self.newest[list] = o;
        } else {
            self.older[w as usize] = o;
        }
        self.older[i] = UNLINKED;
        self.newer[i] = NIL;
        self.len[list] -= 1;
        true
    }

    /// Moves a node (linked anywhere or not) to the newest end of `list`.
    pub fn move_to_newest(&mut self, list: usize, n: u32) {
        if self.list_of(n) == Some(list) && self.newest[list] == n {
            return;
        }
        self.unlink(n);
        self.push_newest(list, n);
    }

    /// Puts the unlinked node `new` where the linked node `old` is, and unlinks `old`.
    pub fn replace(&mut self, old: u32, new: u32) {
        let list = self.list_of(old).expect("replace of an unlinked node");
        debug_assert!(!self.contains(new), "node {new} already linked");
        let (i, j) = (old as usize, new as usize);
        let (o, w) = (self.older[i], self.newer[i]);
        self.older[j] = o;
        self.newer[j] = w;
        if o == NIL {
            self.oldest[list] = new;
        } else {
            self.newer[o as usize] = new;
        }
        if w == NIL {
            self.newest[list] = new;
        } else {
            self.older[w as usize] = new;
        }
        self.set_owner(new, list);
        self.older[i] = UNLINKED;
        self.newer[i] = NIL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(l: &Lists, list: usize) -> Vec<u32> {
        let mut v = Vec::new();
        let mut n = l.oldest(list);
        while let Some(x) = n {
            v.push(x);
            n = l.newer(x);
        }
        assert_eq!(v.len() as u32, l.len(list));
        v
    }

    #[test]
    fn push_unlink_move_replace() {
        let mut l = Lists::new(8, 2);
        for n in 0..4 {
            l.push_newest(0, n);
        }
        l.push_newest(1, 4);
        assert_eq!(order(&l, 0), [0, 1, 2, 3]);
        assert!(l.unlink(1));
        assert!(!l.unlink(1));
        assert_eq!(order(&l, 0), [0, 2, 3]);
        l.move_to_newest(0, 0);
        assert_eq!(order(&l, 0), [2, 3, 0]);
        l.move_to_newest(1, 3);
        assert_eq!(order(&l, 0), [2, 0]);
        assert_eq!(order(&l, 1), [4, 3]);
        l.replace(2, 7);
        assert_eq!(order(&l, 0), [7, 0]);
        assert_eq!(l.list_of(2), None);
        assert_eq!(l.list_of(7), Some(0));
        l.replace(0, 2);
        assert_eq!(order(&l, 0), [7, 2]);
        assert_eq!(l.list_of(100), None);
    }

    /// With one list there is no list byte: membership is read from the `older` link.
    #[test]
    fn one_list_tracks_membership_without_a_list_byte() {
        let mut l = Lists::new(4, 1);
        assert!(l.owner.is_empty());
        assert!((0..4).all(|n| !l.contains(n)));
        l.push_newest(0, 2);
        l.push_newest(0, 0);
        assert_eq!(
            (l.list_of(2), l.list_of(0), l.list_of(1)),
            (Some(0), Some(0), None)
        );
        l.replace(2, 3);
        assert_eq!((l.list_of(2), l.list_of(3)), (None, Some(0)));
        assert_eq!(order(&l, 0), [3, 0]);
        assert!(l.unlink(0));
        assert!(!l.contains(0));
        assert_eq!(order(&l, 0), [3]);
        assert_eq!(l.list_of(4), None);
    }
}
