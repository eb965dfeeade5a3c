//! The token ids of a rank's blocks, by slot.

use super::Slot;

/// Token ids at three bytes each while they fit, four after.
#[derive(Debug)]
pub(super) struct Tokens {
    pub(super) block_size: usize,
    pub(super) width: usize,
    pub(super) bytes: Vec<u8>,
}

impl Tokens {
    pub(super) fn new(block_size: usize) -> Self {
        Tokens {
            block_size,
            width: 3,
            bytes: Vec::new(),
        }
    }

    pub(super) fn stride(&self) -> usize {
        self.block_size * self.width
    }

    fn widen(&mut self) {
        let mut wide = Vec::with_capacity(self.bytes.len() / 3 * 4);
        for chunk in self.bytes.chunks_exact(3) {
            wide.extend_from_slice(&[chunk[0], chunk[1], chunk[2], 0]);
        }
        self.bytes = wide;
        self.width = 4;
    }

    pub(super) fn put(&mut self, slot: Slot, tokens: &[u32]) {
        // (An OR of every token, which vectorizes, rather than a search that stops early.)
        if self.width == 3 && tokens.iter().fold(0, |all, token| all | token) >= 1 << 24 {
            self.widen();
        }
        let stride = self.stride();
        let start = slot as usize * stride;
        if start == self.bytes.len() {
            self.bytes.resize(start + stride, 0);
        }
        let place = &mut self.bytes[start..start + stride];
        // One loop per width, so that each copies a constant number of bytes.
        if self.width == 3 {
            for (place, token) in place.chunks_exact_mut(3).zip(tokens) {
                place.copy_from_slice(&token.to_le_bytes()[..3]);
            }
        } else {
            for (place, token) in place.chunks_exact_mut(4).zip(tokens) {
                place.copy_from_slice(&token.to_le_bytes());
            }
        }
    }

    pub(super) fn read(&self, slot: Slot, out: &mut Vec<u32>) {
        let start = slot as usize * self.stride();
        let stored = &self.bytes[start..start + self.stride()];
        if self.width == 3 {
            out.extend(
                stored
                    .chunks_exact(3)
                    .map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], 0])),
            );
        } else {
            out.extend(
                stored
                    .chunks_exact(4)
                    .map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])),
            );
        }
    }
}
