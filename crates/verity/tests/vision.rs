//! Images decoded and preprocessed as the Hugging Face processors do, checked value for value against the
//! fixtures `scripts/fixtures/make_image_fixtures.py` wrote with Pillow, torchvision and transformers.

mod common;

use std::path::PathBuf;

use verity::vision::{
    decode, resize, Arithmetic, Filter, Gemma3Vision, GridProcessor, ImageLimits, Qwen25Vision,
    Rgb8, SquareProcessor,
};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images")
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn json(name: &str) -> serde_json::Value {
    serde_json::from_slice(&read(name)).unwrap()
}

const IMAGES: [&str; 12] = [
    "rgb.png",
    "rgba.png",
    "gray.png",
    "palette.png",
    "rgb16.png",
    "gray16.png",
    "gray-alpha16.png",
    "rgb.jpg",
    "rgb-422.jpg",
    "rgb-444-progressive.jpg",
    "gray.jpg",
    "cmyk.jpg",
];

/// What Pillow decodes, after transformers' `convert_to_rgb`.
fn decoded(name: &str) -> Rgb8 {
    decode(&read(name), &ImageLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// PNG (8-bit: colour, alpha, grey, palette; 16-bit: colour, grey, grey with alpha) and JPEG (4:2:0, 4:2:2,
/// progressive 4:4:4, grey, CMYK) decode to Pillow's pixels bit for bit.
#[test]
fn images_decode_to_pillows_rgb_pixels() {
    for name in IMAGES {
        let img = decoded(name);
        assert_eq!((img.width, img.height), (61, 45), "{name}");
        assert!(
            img.data == read(&format!("{name}.rgb")),
            "{name}: pixels differ from Pillow's"
        );
    }
}

#[test]
fn resizing_gives_pillows_pixels_shrinking_and_growing_either_axis() {
    let src = decoded("rgb.png");
    let cases = json("resize.json");
    for case in cases["cases"].as_array().unwrap() {
        let (w, h) = (
            case["width"].as_u64().unwrap() as usize,
            case["height"].as_u64().unwrap() as usize,
        );
        let filter = match case["filter"].as_str().unwrap() {
            "bilinear" => Filter::Bilinear,
            _ => Filter::Bicubic,
        };
        let got = resize(&src, w, h, filter, Arithmetic::Pillow);
        let want = read(case["file"].as_str().unwrap());
        assert!(got.data == want, "{case}: differs from Pillow");
    }
}

#[test]
fn gemma3_pixel_values_are_the_hugging_face_processors_bit_for_bit() {
    let fixture = json("gemma3.json");
    let config = &fixture["preprocessor_config"];
    for case in fixture["cases"].as_array().unwrap() {
        let mut config = config.clone();
        if case["backend"] == "pil" {
            config["image_processor_type"] = "Gemma3ImageProcessorPil".into();
        }
        let proc = SquareProcessor::from_config(&config).unwrap();
        let got = proc.pixel_values(&decoded(case["image"].as_str().unwrap()));
        let want: Vec<f32> = read(case["file"].as_str().unwrap())
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(got.len(), want.len());
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{case}: pixel values differ");
    }
}

#[test]
fn broken_and_oversized_images_are_refused_before_decoding() {
    let png = read("rgb.png");
    let limits = ImageLimits::default();
    // Truncated in the middle of its pixel data.
    let e = decode(&png[..png.len() / 2], &limits).unwrap_err();
    assert!(e.to_string().starts_with("image:"), "{e}");
    // A JPEG cut short is refused (libjpeg alone would pad it with grey), as is one whose header is damaged.
    let jpeg = read("rgb-444-progressive.jpg");
    for cut in [jpeg.len() / 3, jpeg.len() - 40] {
        let e = decode(&jpeg[..cut], &limits).unwrap_err().to_string();
        assert!(e.contains("JPEG") && e.contains("ends before"), "{e}");
    }
    let mut damaged = jpeg.clone();
    damaged[6..60].fill(0x55);
    let e = decode(&damaged, &limits).unwrap_err().to_string();
    assert!(e.starts_with("image: JPEG:"), "{e}");
    let e = decode(
        &jpeg,
        &ImageLimits {
            max_side: 60,
            ..limits
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("61×45"), "{e}");
    // A side larger than allowed, found from the header alone.
    let small = ImageLimits {
        max_side: 60,
        ..limits
    };
    let e = decode(&png, &small).unwrap_err().to_string();
    assert!(e.contains("61×45"), "{e}");
    let few = ImageLimits {
        max_pixels: 61 * 45 - 1,
        ..limits
    };
    assert!(decode(&png, &few).is_err());
    let tiny = ImageLimits {
        max_bytes: 100,
        ..limits
    };
    assert!(decode(&png, &tiny)
        .unwrap_err()
        .to_string()
        .contains("bytes"));
}

fn floats(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// A tiny random Gemma 3 image-text bundle (`scripts/fixtures/make_vision_bundles.py`): its preprocessing gives
/// transformers' pixel values bit for bit, and the SigLIP tower and the projector give transformers' outputs
/// within f32 rounding (the sums run in another order).
#[test]
fn gemma3_vision_tower_and_projector_match_transformers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision/gemma3-vl");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("preprocessor_config.json")).unwrap())
            .unwrap();
    let proc = SquareProcessor::from_config(&config).unwrap();
    let pixels = proc.pixel_values(&decoded("rgb.png"));
    let want = floats(&dir.join("pixel_values.f32"));
    assert!(pixels
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let be = std::sync::Arc::new(verity::backend::cpu::CpuBackend::new(2).unwrap());
    let vision = Gemma3Vision::load(&dir, be).unwrap();
    let tower = vision.tower(&pixels).unwrap();
    let e = common::relative_error(&tower, &floats(&dir.join("tower.f32")));
    assert!(e < 1e-5, "tower: relative error {e}");
    let features = vision.image_features(&pixels).unwrap();
    let e = common::relative_error(&features, &floats(&dir.join("features.f32")));
    assert!(e < 1e-5, "features: relative error {e}");
    assert_eq!(features.len(), 4 * 48);
    // The wrong number of pixel values is an error, not a panic.
    assert!(vision.tower(&pixels[1..]).is_err());
}

/// The same bundle's text model with the image's features in place of its 4 image tokens (and those tokens
/// attending to each other both ways): every row's logits match transformers' for the prompt with the image.
#[test]
fn gemma3_text_model_reads_the_image_features_as_transformers_does() {
    use std::sync::Arc;
    use verity::bundle::Bundle;
    use verity::model::{Batch, LogitRows, MediaRows, Model};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision/gemma3-vl");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = reference["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let first = tokens.iter().position(|&t| t == 319).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("preprocessor_config.json")).unwrap())
            .unwrap();
    let pixels = SquareProcessor::from_config(&config)
        .unwrap()
        .pixel_values(&decoded("rgb.png"));
    let be = Arc::new(verity::backend::cpu::CpuBackend::new(2).unwrap());
    let features = Gemma3Vision::load(&dir, be.clone())
        .unwrap()
        .image_features(&pixels)
        .unwrap();
    let mut model = Model::load(&Bundle::open(&dir).unwrap(), be).unwrap();
    let media = vec![MediaRows {
        first_row: first,
        rows: 4,
        values: Arc::new(features),
    }];
    let want = floats(&dir.join("logits.f32"));
    let mut cache = model.new_cache(64);
    let batch = Batch::with_media(&tokens, 0, media.clone());
    let got = model
        .forward(&mut cache, &batch, LogitRows::All, &[])
        .unwrap()
        .logits;
    let e = common::relative_error(&got, &want);
    assert!(e < 1e-4, "logits: relative error {e}");
    // Without the image's rows seeing each other both ways, the logits are not transformers'.
    let mut cache = model.new_cache(64);
    let causal = Batch {
        mask: verity::backend::AttnMask::Causal,
        ..batch
    };
    let got = model
        .forward(&mut cache, &causal, LogitRows::All, &[])
        .unwrap()
        .logits;
    assert!(common::relative_error(&got, &want) > 1e-3);
    // Image rows that do not fit the batch are refused.
    let bad = Batch::with_media(&tokens[..first + 2], 0, media);
    assert!(model
        .forward(&mut model.new_cache(64), &bad, LogitRows::All, &[])
        .is_err());
}

/// An engine on the tiny image-text bundle (its vision side found in the folder) and two images' prompt ids:
/// text, then the image's block (`<start_of_image>`, its 4 content-keyed rows, `<end_of_image>`), then text.
type CpuEngine = verity::engine::Engine<verity::backend::cpu::CpuBackend>;

fn image_turns() -> (CpuEngine, Vec<(Vec<u32>, verity::engine::PromptImage)>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision/gemma3-vl");
    let (engine, turns) = image_turns_in(&dir);
    let vision = engine.vision.as_ref().expect("an image-text bundle");
    assert_eq!(
        (vision.begin, vision.end, vision.tokens),
        (317, 318, Some(4))
    );
    (engine, turns)
}

/// An engine on the image-text bundle `dir` and two images' prompt ids: text, the image's block, text.
fn image_turns_in(
    dir: &std::path::Path,
) -> (CpuEngine, Vec<(Vec<u32>, verity::engine::PromptImage)>) {
    use std::sync::Arc;
    use verity::engine::Engine;
    use verity::speculative::SpecMode;
    let be = Arc::new(verity::backend::cpu::CpuBackend::new(2).unwrap());
    let engine = Engine::load(dir, be, &SpecMode::Off).unwrap();
    let vision = engine.vision.as_ref().expect("an image-text bundle");
    let turns = ["rgb.png", "gray.png"]
        .iter()
        .map(|name| {
            let img = vision.image(&read(name), &ImageLimits::default()).unwrap();
            let mut ids = vec![2, 10, 11, 12];
            ids.extend(vision.block(&img));
            ids.extend([20, 21, 22]);
            (ids, img)
        })
        .collect();
    (engine, turns)
}

/// A 12-token greedy answer to an image turn that stores its prefix: the answer and how much was restored.
fn answer(e: &mut CpuEngine, ids: &[u32], img: &verity::engine::PromptImage) -> (Vec<u32>, usize) {
    let req = verity::engine::GenerateRequest {
        ignore_eos: true,
        images: vec![img.clone()],
        store_prefix: Some(ids.len() - 1),
        ..verity::engine::GenerateRequest::greedy(12)
    };
    let (out, _, stats) = common::answer(e, ids, &req);
    (out, stats.restored_tokens)
}

/// An image turn through the engine: the answer is greedy decoding of the model on the image's features (the
/// first token the prefill's last logits pick); a second run of the same turn restores its whole prefix from the
/// prefix cache and answers the same; the same text with another image restores only the text before the image
/// and answers from its own.
#[test]
fn image_turns_restore_their_own_prefix_and_never_another_images() {
    let (mut e, turns) = image_turns();
    e.set_prefix_cache_budget(64 << 20);
    let (ids, img) = &turns[0];
    let (cold, restored) = answer(&mut e, ids, img);
    assert_eq!(restored, 0);
    let (warm, restored) = answer(&mut e, ids, img);
    assert_eq!(warm, cold, "restored turn differs from the cold one");
    assert_eq!(restored, ids.len() - 1, "the whole prompt body restores");
    let (other_ids, other) = &turns[1];
    let (theirs, restored) = answer(&mut e, other_ids, other);
    assert!(
        restored <= 5,
        "another image restored {restored} rows of the first's prefix"
    );
    // Cold, without the cache: the same answer.
    e.set_prefix_cache_budget(0);
    let (alone, _) = answer(&mut e, other_ids, other);
    assert_eq!(theirs, alone);
    // The two images' prompts differ only in the image rows' inputs, and so do their last rows' logits.
    use verity::model::{Batch, LogitRows, MediaRows};
    let last: Vec<Vec<f32>> = turns
        .iter()
        .map(|(ids, img)| {
            let mut tokens = ids.clone();
            tokens[5..9].fill(0);
            let batch = Batch::with_media(
                &tokens,
                0,
                vec![MediaRows {
                    first_row: 5,
                    rows: 4,
                    values: img.features.get().unwrap(),
                }],
            );
            let mut cache = e.model.new_cache(64);
            e.model
                .forward(&mut cache, &batch, LogitRows::Last, &[])
                .unwrap()
                .logits
        })
        .collect();
    assert!(
        common::relative_error(&last[0], &last[1]) > 1e-3,
        "the image rows' features were not read"
    );
}

/// An image row id that belongs to no image of the request, or a prompt ending inside an image, is refused.
#[test]
fn image_rows_must_belong_to_the_request_and_not_end_the_prompt() {
    use verity::engine::GenerateRequest;
    let (mut e, turns) = image_turns();
    let (ids, img) = &turns[0];
    let mut s = e.new_session();
    let no_images = GenerateRequest::greedy(2);
    assert!(e.generate(&mut s, ids, &no_images, |_, _| true).is_err());
    let ends_inside = GenerateRequest {
        images: vec![img.clone()],
        ..GenerateRequest::greedy(2)
    };
    assert!(e
        .generate(&mut s, &ids[..7], &ends_inside, |_, _| true)
        .is_err());
}

/// A random block drafter (one layer) for the fixtures' 48-wide, 2-layer text models, in `dir`.
fn write_random_drafter(dir: &std::path::Path) {
    let s = common::DrafterShape {
        hidden: 48,
        target_layers: vec![0, 1],
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 24,
        ffn: 96,
        block: 8,
        mask: 3,
    };
    common::write_drafter(
        dir,
        &common::drafter_config(&s),
        &common::random_drafter(&s, 5),
    );
}

/// The image-text bundle with a random MTP head and a random block drafter beside it.
fn image_bundle_with_proposers() -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision/gemma3-vl");
    let dir = common::copy_folder(&src, "vision-routes");
    // Gemma 3's blocks norm each head of Q and K, and around the MLP: the head's block does too.
    let mut head = common::random_mtp_head(48, 2, 1, 24, 96, 7, None);
    let p = "mtp.layers.0.";
    for (name, n) in [
        ("self_attn.q_norm", 24),
        ("self_attn.k_norm", 24),
        ("pre_feedforward_layernorm", 48),
        ("post_feedforward_layernorm", 48),
    ] {
        let ones = common::f32_bytes(&vec![1.0; n]);
        head.push((format!("{p}{name}.weight"), "F32", vec![n], ones));
    }
    common::write_safetensors(
        &dir.join("mtp.safetensors"),
        &head,
        &[("num_nextn_predict_layers", "1")],
    );
    write_random_drafter(&dir);
    dir
}

/// Every speculative route on image turns: copying (never an image row), the MTP head (the image's rows
/// embedded as the image token, read through the target's states), the block drafter and `auto` draft, and
/// every answer is AR's, token for token; a turn answered again restores its whole prefix, image included, and
/// answers the same.
#[test]
fn every_route_gives_ars_answer_on_image_turns() {
    let (mut ar, turns) = image_turns();
    let dir = image_bundle_with_proposers();
    every_route_answers_as_ar(&mut ar, &turns, &dir);
}

/// Every route (copying, the MTP head, the block drafter, `auto`) on the bundle `dir` (its copy with both
/// proposers, removed afterwards) answers each image turn as `ar` does, drafting, and answers it again from its
/// whole restored prefix.
fn every_route_answers_as_ar(
    ar: &mut CpuEngine,
    turns: &[(Vec<u32>, verity::engine::PromptImage)],
    dir: &std::path::Path,
) {
    use verity::engine::{Engine, GenerateRequest};
    use verity::speculative::SpecMode;
    for mode in &[
        SpecMode::Copy,
        SpecMode::Mtp,
        SpecMode::Drafter,
        SpecMode::Auto,
    ] {
        let be = std::sync::Arc::new(verity::backend::cpu::CpuBackend::new(2).unwrap());
        let mut e = Engine::load(dir, be, mode).unwrap();
        e.set_prefix_cache_budget(64 << 20);
        for (ids, img) in turns {
            let req = GenerateRequest {
                ignore_eos: true,
                images: vec![img.clone()],
                store_prefix: Some(ids.len() - 1),
                ..GenerateRequest::greedy(40)
            };
            let (want, _, _) = common::answer(ar, ids, &req);
            let (got, _, stats) = common::answer(&mut e, ids, &req);
            assert_eq!(
                got, want,
                "{mode:?}: the answer differs from AR's on an image turn"
            );
            assert!(
                stats.drafted > 0,
                "{mode:?} drafted nothing on an image turn"
            );
            let (again, _, stats) = common::answer(&mut e, ids, &req);
            assert_eq!(again, want, "{mode:?}: the restored turn differs");
            assert_eq!(
                stats.restored_tokens,
                ids.len() - 1,
                "{mode:?}: the prefix did not restore"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The disk tier keys image turns by content too: after a restart (a new engine, the same folder) the image turn
/// restores its prefix from disk and answers as before, without running the tower (no forward needs the image's
/// features); the other image restores none of the first's rows and runs it.
#[test]
fn image_turns_restore_from_the_disk_tier_after_a_restart() {
    let root = std::env::temp_dir().join(format!("verity-vision-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (mut e, turns) = image_turns();
    assert!(e.set_prefix_cache_dir(&root, 1 << 30));
    let (ids, img) = &turns[0];
    let (cold, _) = answer(&mut e, ids, img);
    drop(e.prefix_disk()); // every queued store written
    drop(e);
    let (mut restarted, turns) = image_turns();
    assert!(restarted.set_prefix_cache_dir(&root, 1 << 30));
    let (warm, restored) = answer(&mut restarted, ids, img);
    assert_eq!(restored, ids.len() - 1, "restored from disk");
    assert_eq!(warm, cold);
    let vision = restarted.vision.as_ref().expect("an image-text bundle");
    assert_eq!(
        vision.tower_runs(),
        0,
        "the tower ran for rows restored from disk"
    );
    let (other_ids, other) = &turns[1];
    let (_, restored) = answer(&mut restarted, other_ids, other);
    assert!(
        restored <= 5,
        "another image restored {restored} rows from disk"
    );
    let vision = restarted.vision.as_ref().expect("an image-text bundle");
    assert_eq!(
        vision.tower_runs(),
        1,
        "the other image's rows need the tower"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// An image sent again (a chat client resends the conversation's image with every turn) shares the features of
/// its first sending, while it is among the last [`FEATURE_CACHE_IMAGES`]; pushed out, it is computed afresh, to
/// the same values. Other bytes are another image, whatever their pixels. Features are computed once, when
/// first needed, however many sendings share them.
#[test]
fn an_image_sent_again_takes_the_features_computed_the_first_time() {
    use verity::engine::FEATURE_CACHE_IMAGES;
    let (e, _) = image_turns();
    let vision = e.vision.as_ref().expect("an image-text bundle");
    let limits = ImageLimits::default();
    let rgb = read("rgb.png");
    let runs = vision.tower_runs();
    let first = vision.image(&rgb, &limits).unwrap();
    let again = vision.image(&rgb, &limits).unwrap();
    assert!(first.features.same(&again.features));
    assert_eq!(first.ids, again.ids);
    assert_eq!(
        vision.tower_runs(),
        runs,
        "no forward needed the features yet"
    );
    let values = again.features.get().unwrap();
    assert!(first.features.is_computed());
    assert_eq!(*first.features.get().unwrap(), *values);
    assert_eq!(vision.tower_runs(), runs + 1);
    // The same pixels in other bytes (a trailing word after the PNG's end): other images, as many as the cache
    // holds.
    for i in 0..FEATURE_CACHE_IMAGES as u32 {
        let mut bytes = rgb.clone();
        bytes.extend_from_slice(&i.to_le_bytes());
        let other = vision.image(&bytes, &limits).unwrap();
        assert!(!other.features.same(&first.features));
        assert_ne!(other.ids, first.ids);
        assert_eq!(*other.features.get().unwrap(), *values);
    }
    let back = vision.image(&rgb, &limits).unwrap();
    assert!(!back.features.same(&first.features));
    assert_eq!(*back.features.get().unwrap(), *values);
    assert_eq!(back.ids, first.ids);
}

fn qwen_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision/qwen25-vl")
}

fn qwen_processor() -> GridProcessor {
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(qwen_dir().join("preprocessor_config.json")).unwrap(),
    )
    .unwrap();
    GridProcessor::from_config(&config).unwrap()
}

/// Qwen2-VL's `smart_resize` sizes (transformers' table, `scripts/fixtures/make_qwen25vl_bundle.py`): growing
/// small images, shrinking large ones, keeping those within bounds to the nearest multiples, and refusing
/// aspect ratios beyond 200.
#[test]
fn qwen_images_resize_to_transformers_grid_sizes() {
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(qwen_dir().join("smart_resize.json")).unwrap())
            .unwrap();
    let base = qwen_processor();
    for c in cases.as_array().unwrap() {
        let n = |k: &str| c[k].as_u64().unwrap() as usize;
        let p = GridProcessor {
            min_pixels: n("min_pixels"),
            max_pixels: n("max_pixels"),
            ..base.clone()
        };
        let got = p.resized(n("height"), n("width")).ok();
        let want = c["resized"].as_array().map(|v| {
            [
                v[0].as_u64().unwrap() as usize,
                v[1].as_u64().unwrap() as usize,
            ]
        });
        assert_eq!(got, want, "{c}");
    }
}

/// The tiny Qwen2.5-VL bundle: the processor gives transformers' pixel values (patches merged square by square,
/// each over two repeated frames) bit for bit and its grid, and the vision transformer (window attention in two
/// layers, full attention in one, 2-D rotary positions) and the merger give transformers' image features within
/// f32 rounding.
#[test]
fn qwen25_vision_tower_and_merger_match_transformers() {
    let dir = qwen_dir();
    let reference = json("../vision/qwen25-vl/reference.json");
    let (pixels, grid) = qwen_processor().pixel_values(&decoded("rgb.png")).unwrap();
    let want_grid: Vec<usize> = reference["grid_thw"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(vec![1, grid[0], grid[1]], want_grid);
    let want = floats(&dir.join("pixel_values.f32"));
    assert_eq!(pixels.len(), want.len());
    let differing = pixels
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differing, 0, "pixel values differ from transformers'");
    let be = std::sync::Arc::new(verity::backend::cpu::CpuBackend::new(2).unwrap());
    let vision = Qwen25Vision::load(&dir, be).unwrap();
    let features = vision.image_features(&pixels, grid).unwrap();
    let e = common::relative_error(&features, &floats(&dir.join("features.f32")));
    assert!(e < 1e-5, "features: relative error {e}");
    assert_eq!(features.len(), 20 * 48);
    // A grid that does not hold the pixel values, or does not merge, is an error, not a panic.
    assert!(vision.image_features(&pixels, [8, 8]).is_err());
    assert!(vision.image_features(&pixels[..1176 * 15], [3, 5]).is_err());
}

/// The tiny Qwen2.5-VL bundle's text model (Qwen2 blocks, multimodal rotary positions) with the image's
/// features in place of its 20 image tokens at transformers' position ids (the image's rows at its grid's
/// heights and widths, the text after it resuming at the image's start plus its longer side): every row's
/// logits match transformers'. At plain consecutive positions they do not.
#[test]
fn qwen25_text_model_reads_the_image_at_multimodal_positions() {
    use std::sync::Arc;
    use verity::bundle::Bundle;
    use verity::model::{Batch, LogitRows, MediaRows, Model};
    let dir = qwen_dir();
    let reference = json("../vision/qwen25-vl/reference.json");
    let list = |v: &serde_json::Value| -> Vec<usize> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as usize)
            .collect()
    };
    let tokens: Vec<u32> = list(&reference["token_ids"])
        .into_iter()
        .map(|t| t as u32)
        .collect();
    let pos: Vec<Vec<usize>> = reference["position_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(list)
        .collect();
    let first = tokens.iter().position(|&t| t == 319).unwrap();
    let be = Arc::new(verity::backend::cpu::CpuBackend::new(2).unwrap());
    let features = floats(&dir.join("features.f32"));
    let bundle = Bundle::open(&dir).unwrap();
    assert_eq!(bundle.hparams.block.mrope, Some([2, 5, 5]));
    let mut model = Model::load(&bundle, be).unwrap();
    let media = vec![MediaRows {
        first_row: first,
        rows: 20,
        values: Arc::new(features),
    }];
    let mut input = tokens.clone();
    input[first..first + 20].fill(0);
    let spatial = (0..tokens.len()).map(|i| [pos[1][i], pos[2][i]]).collect();
    let batch = Batch::with_positioned_media(&input, pos[0].clone(), spatial, media.clone());
    let want = floats(&dir.join("logits.f32"));
    let got = model
        .forward(&mut model.new_cache(64), &batch, LogitRows::All, &[])
        .unwrap()
        .logits;
    let e = common::relative_error(&got, &want);
    assert!(e < 1e-4, "logits: relative error {e}");
    let plain = Batch::with_positioned_media(
        &input,
        (0..tokens.len()).collect(),
        (0..tokens.len()).map(|i| [i, i]).collect(),
        media,
    );
    let got = model
        .forward(&mut model.new_cache(64), &plain, LogitRows::All, &[])
        .unwrap()
        .logits;
    assert!(common::relative_error(&got, &want) > 1e-3);
}

/// The Qwen2.5-VL bundle through the engine: an image turn's prompt is transformers' (text, `<|vision_start|>`,
/// the image's 20 rows, `<|vision_end|>`, text) and its greedy answer is transformers' `generate` of it, token
/// for token (the image's rows at their grid positions, the answer's at positions that lag its slots); the same
/// answer restored from the prefix cache, batched beside another request, and alone; another image restores
/// only the text before it.
#[test]
fn qwen25_image_turns_answer_as_transformers_generates() {
    use verity::engine::GenerateRequest;
    let (mut e, turns) = image_turns_in(&qwen_dir());
    let vision = e.vision.as_ref().expect("an image-text bundle");
    assert_eq!((vision.begin, vision.end, vision.tokens), (317, 318, None));
    let reference = json("../vision/qwen25-vl/reference.json");
    let ids_of = |k: &str| common::ids(&reference[k]);
    let (ids, img) = &turns[0];
    assert_eq!(img.grid, Some([4, 5]));
    let text: Vec<u32> = ids
        .iter()
        .map(|&t| if verity::engine::is_media(t) { 319 } else { t })
        .collect();
    assert_eq!(text, ids_of("token_ids"));
    e.set_prefix_cache_budget(64 << 20);
    let (cold, restored) = answer(&mut e, ids, img);
    assert_eq!(restored, 0);
    assert_eq!(
        cold,
        ids_of("greedy_continuation_ids"),
        "transformers' greedy answer"
    );
    let (warm, restored) = answer(&mut e, ids, img);
    assert_eq!(restored, ids.len() - 1, "the whole prompt body restores");
    assert_eq!(warm, cold, "restored turn differs from the cold one");
    let (other_ids, other) = &turns[1];
    let (theirs, restored) = answer(&mut e, other_ids, other);
    assert!(restored <= 5, "another image restored {restored} rows");
    e.set_prefix_cache_budget(0);
    let (alone, _) = answer(&mut e, other_ids, other);
    assert_eq!(theirs, alone);
    // Batched: both image turns side by side, each answers as alone.
    let mut batch: Vec<_> = turns
        .iter()
        .map(|(ids, img)| {
            let req = GenerateRequest {
                ignore_eos: true,
                images: vec![img.clone()],
                ..GenerateRequest::greedy(12)
            };
            let s = e.new_session();
            e.start_decoding(s, ids, req).unwrap()
        })
        .collect();
    let mut got = vec![Vec::new(); 2];
    while batch.iter().any(|d| !d.is_finished()) {
        e.decode_step(&mut batch, |i, _, t| {
            got[i].push(t.id);
            true
        })
        .unwrap();
    }
    assert_eq!(
        got,
        vec![cold, alone],
        "batched image turns differ from solo ones"
    );
}

/// Every route on Qwen2.5-VL image turns (copying, a random MTP head, a random block drafter, `auto`) gives AR's
/// answer, and a turn answered again restores its whole prefix and answers the same.
#[test]
fn every_route_gives_ars_answer_on_qwen25_image_turns() {
    let (mut ar, turns) = image_turns_in(&qwen_dir());
    let dir = common::copy_folder(&qwen_dir(), "qwen-vision-routes");
    write_random_drafter(&dir);
    // Qwen2's blocks add biases to Q, K and V: the head's block does too.
    let mut head = common::random_mtp_head(48, 2, 1, 24, 96, 7, None);
    for (name, n, seed) in [("q_proj", 48, 1), ("k_proj", 24, 2), ("v_proj", 24, 3)] {
        let bias = common::f32_bytes(&common::random_f32(n, seed, 0.1));
        head.push((
            format!("mtp.layers.0.self_attn.{name}.bias"),
            "F32",
            vec![n],
            bias,
        ));
    }
    common::write_safetensors(
        &dir.join("mtp.safetensors"),
        &head,
        &[("num_nextn_predict_layers", "1")],
    );
    every_route_answers_as_ar(&mut ar, &turns, &dir);
}
