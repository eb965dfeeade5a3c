use super::fast::small_uint_width;
use super::*;

/// Runs `test` on each path of `Reader::small_uints` this machine has: the AVX-512 VBMI windows
/// where the CPU has them, and the scalar loop alone.
fn on_every_token_path(test: impl Fn()) {
    test();
    #[cfg(target_arch = "x86_64")]
    {
        super::vbmi::SCALAR_ONLY.set(true);
        test();
        super::vbmi::SCALAR_ONLY.set(false);
    }
}

#[test]
fn reads_every_integer_width() {
    let cases: &[(&[u8], Item<'_>)] = &[
        (&[0x05], Item::UInt(5)),
        (&[0xcc, 0xff], Item::UInt(255)),
        (&[0xcd, 0x01, 0x00], Item::UInt(256)),
        (
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            Item::UInt(u64::MAX),
        ),
        (&[0xff], Item::NegInt(-1)),
        (&[0xd0, 0x05], Item::UInt(5)),
        (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Item::NegInt(i64::MIN)),
    ];
    for (bytes, want) in cases {
        assert_eq!(Reader::new(bytes).item().unwrap(), *want, "{bytes:02x?}");
    }
}

#[test]
fn refuses_lengths_past_the_input() {
    assert_eq!(
        Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).item(),
        Err(ReadError::Truncated)
    );
    assert_eq!(Reader::new(&[0xa3, b'a']).item(), Err(ReadError::Truncated));
    assert_eq!(Reader::new(&[0xa1, 0xff]).item(), Err(ReadError::Utf8));
    assert_eq!(Reader::new(&[0xc1]).item(), Err(ReadError::BadMarker(0xc1)));
}

#[test]
fn skip_bounds_depth_without_recursion() {
    let mut deep = vec![0x91u8; 100_000];
    deep.push(0xc0);
    assert_eq!(Reader::new(&deep).skip(0), Err(ReadError::TooDeep));
    let mut too_deep = vec![0x91u8; MAX_DEPTH + 1];
    too_deep.push(0x90);
    assert_eq!(Reader::new(&too_deep).skip(0), Err(ReadError::TooDeep));
    let mut ok = vec![0x91u8; MAX_DEPTH - 1];
    ok.push(0x90);
    let mut reader = Reader::new(&ok);
    reader.skip(0).unwrap();
    assert!(reader.is_empty());
}

#[test]
fn lax_reads_leave_strings_and_lengths_unchecked() {
    assert_eq!(Reader::new(&[0xa1, 0xff]).lax(), Ok(Lax::Str(&[0xff])));
    assert_eq!(
        Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).lax(),
        Ok(Lax::Item(Item::Array(u32::MAX as usize)))
    );
    let mut reader = Reader::new(&[0x92, 0xa1, 0xff, 0xc0]);
    reader.skip_lax(0).unwrap();
    assert!(reader.is_empty());
    assert_eq!(
        Reader::new(&[0x92, 0xa1, 0xff, 0xc0]).skip(0),
        Err(ReadError::Utf8)
    );
}

#[test]
fn too_deep_locates_the_first_container_past_the_limit() {
    let mut deep = vec![0x93, 0x00, 0x92, 0xc0];
    deep.extend(std::iter::repeat_n(0x91, MAX_DEPTH - 1));
    let path = too_deep(&deep).unwrap();
    assert_eq!(path.len(), MAX_DEPTH);
    assert_eq!(&path[..2], &[(1, false), (1, false)]);
    deep.truncate(deep.len() - 1);
    deep.push(0xc0);
    assert_eq!(too_deep(&deep), None);
    // Truncated or malformed before the limit: no answer.
    assert_eq!(too_deep(&[0x91, 0x91, 0xdc]), None);
    assert_eq!(too_deep(&[0x92, 0xc1, 0x91]), None);
}

#[test]
fn fixstr_is_what_the_writer_writes_and_consume_matches() {
    const TAG: [u8; 13] = fixstr("BlockRemoved");
    assert_eq!(TAG, *b"\xacBlockRemoved");
    let mut written = Vec::new();
    write::str(&mut written, "BlockRemoved");
    assert_eq!(written, TAG);
    written.push(0xc0);
    let mut reader = Reader::new(&written);
    assert!(!reader.consume(&fixstr::<4>("GPU")));
    assert!(reader.consume(&TAG));
    assert!(!reader.consume(&TAG));
    assert!(reader.nil());
}

#[test]
fn small_uint_width_is_what_small_uint_reads() {
    for marker in 0..=u8::MAX {
        let bytes = [marker, 0, 0, 0, 0, 0, 0, 0, 0];
        let mut reader = Reader::new(&bytes);
        let width = reader.small_uint().map_or(0, |_| reader.pos);
        assert_eq!(usize::from(small_uint_width(marker)), width, "{marker:#x}");
    }
}

#[test]
fn small_uints_stop_where_the_general_path_takes_over() {
    on_every_token_path(|| {
        // 200 tokens of every width, then a nil: read across windows, up to the nil, or up to
        // the last eight bytes, whichever comes first.
        let values: Vec<u32> = (0..200u32)
            .map(|i| [5, 200, 70_000, 300][i as usize % 4])
            .collect();
        let mut bytes = Vec::new();
        write::small_uints(&mut bytes, &values);
        let tokens_end = bytes.len();
        bytes.extend_from_slice(&[0xc0; 8]);
        for count in [0, 1, 63, 64, 65, 128, 200, 201] {
            let mut reader = Reader::new(&bytes);
            let mut out = vec![7];
            let read = reader.small_uints(count, &mut out);
            let expected = count.min(200);
            assert_eq!(
                read,
                SmallUints {
                    count: expected,
                    shortest: true
                }
            );
            assert_eq!(out[1..], values[..expected]);
            let mut written = Vec::new();
            write::small_uints(&mut written, &values[..expected]);
            assert_eq!(reader.pos, written.len());
        }
        // Without the padding the last tokens are left to the general path: the last one
        // read is the last with eight bytes from its start.
        let mut out = Vec::new();
        let read = Reader::new(&bytes[..tokens_end]).small_uints(200, &mut out);
        assert_eq!(read.count, 199);
        assert_eq!(out, values[..199]);
    });
}

/// What `small_uints` reads, one `small_uint` at a time: items with eight bytes from their
/// start, up to the first other one.
fn small_uints_one_by_one(data: &[u8], pos: usize, count: usize) -> (Vec<u32>, usize) {
    let mut reader = Reader::new(data);
    reader.pos = pos;
    let mut values = Vec::new();
    while values.len() < count && data.len() - reader.pos >= 8 {
        match reader.small_uint() {
            Some(value) => values.push(value),
            None => break,
        }
    }
    (values, reader.pos)
}

#[test]
fn small_uints_read_what_small_uint_reads_from_any_start() {
    on_every_token_path(|| {
        // Every width, a wide form the fast path leaves (uint64), and a nil, twice.
        let mut bytes = Vec::new();
        for round in 0..2u32 {
            let values: Vec<u32> = (0..150)
                .map(|i| [9, 200, 60_000, 1 << 20][i % 4] + round)
                .collect();
            write::small_uints(&mut bytes, &values);
            bytes.extend_from_slice(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 1, 0xc0]);
        }
        for end in [bytes.len(), bytes.len() - 9, 700, 300, 10, 7, 0] {
            let data = &bytes[..end];
            for pos in 0..=end {
                for count in [0, 1, 5, 64, 65, 150, 400] {
                    let mut reader = Reader::new(data);
                    reader.pos = pos;
                    let mut out = vec![1, 2];
                    let read = reader.small_uints(count, &mut out);
                    let (expected, expected_pos) = small_uints_one_by_one(data, pos, count);
                    assert_eq!(
                        read.count,
                        expected.len(),
                        "end {end} pos {pos} count {count}"
                    );
                    assert_eq!(out[2..], expected[..]);
                    assert_eq!(reader.pos, expected_pos);
                }
            }
        }
    });
}

/// Random runs of small uints in every form, shortest or not, broken by items of other forms
/// (a nil, a uint64, an array header, a string) and by markers inside values: `small_uints`
/// reads from any start what `small_uint` reads one at a time, and says whether every form was
/// the shortest. On x86-64 machines with AVX-512 VBMI this checks the `vbmi` windows (a whole
/// run of windows, fixed-stride entries, the limit within a window, windows of 1 to 57 tokens)
/// against the scalar read; elsewhere it checks the scalar loop alone.
#[test]
fn small_uints_read_random_runs_as_small_uint_does() {
    on_every_token_path(|| {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        for case in 0..3_000 {
            let mut bytes = Vec::new();
            for _ in 0..next(300) {
                // One case in four is of fixints only: up to 57 tokens in a window.
                let value = match if case % 4 == 1 { 0 } else { next(4) } {
                    0 => next(0x80),
                    1 => next(0x100),
                    2 => next(0x1_0000),
                    _ => next(1 << 32),
                } as u32;
                match next(40) {
                    0 => bytes.extend_from_slice(&[0xcc, value as u8]),
                    1 => bytes.extend_from_slice(&[0xcd, (value >> 8) as u8, value as u8]),
                    2 => {
                        bytes.push(0xce);
                        bytes.extend_from_slice(&value.to_be_bytes());
                    }
                    3 if case % 4 != 0 => bytes.extend_from_slice(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 1]),
                    4 if case % 4 != 0 => bytes.extend_from_slice(&[0xc0, 0x92, 0xa1, b'x']),
                    _ => write::small_uints(&mut bytes, &[value]),
                }
            }
            let starts = [0, next(bytes.len() as u64 + 1) as usize];
            for (pos, count) in starts.into_iter().zip([usize::MAX, next(400) as usize]) {
                let mut reader = Reader::new(&bytes);
                reader.pos = pos;
                let mut out = vec![7];
                let read = reader.small_uints(count, &mut out);
                let (expected, expected_pos) = small_uints_one_by_one(&bytes, pos, count);
                let shortest_widths: usize = expected
                    .iter()
                    .map(|&value| {
                        let mut form = Vec::new();
                        write::small_uints(&mut form, &[value]);
                        form.len()
                    })
                    .sum();
                let expected_read = SmallUints {
                    count: expected.len(),
                    shortest: shortest_widths == expected_pos - pos,
                };
                assert_eq!(read, expected_read, "case {case} pos {pos} count {count}");
                assert_eq!(
                    out[1..],
                    expected[..],
                    "case {case} pos {pos} count {count}"
                );
                assert_eq!(
                    reader.pos, expected_pos,
                    "case {case} pos {pos} count {count}"
                );
            }
        }
    });
}

#[test]
fn small_uints_tell_whether_every_form_was_the_shortest() {
    let values = [0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
    let mut shortest = Vec::new();
    write::small_uints(&mut shortest, &values);
    shortest.extend_from_slice(&[0xc0; 8]);
    let mut out = Vec::new();
    let read = Reader::new(&shortest).small_uints(values.len(), &mut out);
    assert_eq!(
        read,
        SmallUints {
            count: 8,
            shortest: true
        }
    );
    assert_eq!(out, values);
    // 5 as a uint8, 200 as a uint16, 70,000 as a uint32 (shortest), 1 as a uint32.
    let longer = [
        0xcc, 5, 0xcd, 0, 200, 0xce, 0, 1, 0x11, 0x70, 0xce, 0, 0, 0, 1,
    ];
    let longer: Vec<u8> = longer.iter().copied().chain([0xc0; 8]).collect();
    for (count, shortest) in [(1, false), (3, false), (4, false)] {
        let mut out = Vec::new();
        let read = Reader::new(&longer).small_uints(count, &mut out);
        assert_eq!(read, SmallUints { count, shortest });
    }
    let mut out = Vec::new();
    let read = Reader::new(&longer[5..]).small_uints(1, &mut out);
    assert_eq!(
        (read, out),
        (
            SmallUints {
                count: 1,
                shortest: true
            },
            vec![70_000]
        )
    );
}

#[test]
fn writers_pick_the_smallest_form() {
    let values = [0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
    let mut each = Vec::new();
    for value in values {
        write::uint(&mut each, u64::from(value));
    }
    let mut all = vec![0xc0];
    write::small_uints(&mut all, &values);
    assert_eq!(all[1..], each[..]);
    for value in [0, 1 << 32, u64::MAX] {
        let (mut one, mut other) = (Vec::new(), Vec::new());
        write::uint(&mut one, value);
        write::hash(&mut other, value);
        assert_eq!(one, other);
    }
    let mut out = Vec::new();
    write::uint(&mut out, 127);
    write::uint(&mut out, 128);
    write::uint(&mut out, 70_000);
    assert_eq!(out, [0x7f, 0xcc, 0x80, 0xce, 0x00, 0x01, 0x11, 0x70]);
}
