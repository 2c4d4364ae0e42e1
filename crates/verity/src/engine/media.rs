//! Images in a prompt. An image's rows carry ids derived from its content (its bytes and how they were
//! preprocessed) instead of one placeholder id: the session's cached prefix and the prefix cache's keys (RAM and
//! disk) are token sequences, so two different images never share a prefix and the same image restores its
//! own, with no other change to the cache. The ids have the top bit set, outside every vocabulary: a forward
//! gets the image's features for those rows ([`crate::model::MediaRows`]) and a placeholder token, and the copy
//! proposer never copies them.

use std::collections::HashMap;
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::{Batch, MediaRows};

/// The bit that marks a prompt id as an image's row.
pub const MEDIA_BIT: u32 = 1 << 31;

/// Whether `id` is an image's row rather than a token.
pub fn is_media(id: u32) -> bool {
    id & MEDIA_BIT != 0
}

/// One image of a prompt: the ids its rows take (one per image token) and its features.
#[derive(Debug, Clone)]
pub struct PromptImage {
    pub ids: Vec<u32>,
    pub features: ImageFeatures,
    /// Where the rows sit at multimodal rotary positions (Qwen2.5-VL): the image's grid of merged patches,
    /// `[rows, columns]`, its rows in row-major order. `None`: consecutive positions, the rows seeing each
    /// other both ways (Gemma 3).
    pub grid: Option<[usize; 2]>,
}

/// The content key of an image: a 128-bit hash of its encoded bytes and of `settings` (how it is preprocessed:
/// the same bytes resized for another tower are another input).
pub fn content_key(bytes: &[u8], settings: &str) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
    h.update(settings.as_bytes());
    h.digest128()
}

impl PromptImage {
    /// The image whose content key is `key` (a hash of its bytes and its preprocessing settings), its features
    /// `features` for `tokens` rows: row `i`'s id is 31 bits of a hash of `(key, i)`, so every row's id depends
    /// on the whole content and two images' id sequences differ everywhere.
    pub fn new(
        key: u128,
        tokens: usize,
        features: ImageFeatures,
        grid: Option<[usize; 2]>,
    ) -> Self {
        let ids = (0..tokens as u64)
            .map(|i| {
                let h = xxhash_rust::xxh3::xxh3_64_with_seed(&key.to_le_bytes(), i);
                MEDIA_BIT | (h as u32 & !MEDIA_BIT)
            })
            .collect();
        PromptImage {
            ids,
            features,
            grid,
        }
    }

    /// The positions the rows after this image lag behind their slots: its rows less its grid's longer side
    /// (0 at consecutive positions).
    fn lag(&self) -> usize {
        self.grid.map_or(0, |[r, c]| r * c - r.max(c))
    }
}

/// An image's features (one row of the text model's width per image token), computed when a forward first
/// needs them: a turn whose image rows all restore from the prefix cache (after a restart too) never runs the
/// tower, which costs seconds to minutes where the restore costs milliseconds. Clones share one computation.
#[derive(Clone)]
pub struct ImageFeatures(Arc<FeatureCell>);

struct FeatureCell {
    ready: std::sync::OnceLock<Arc<Vec<f32>>>,
    /// What computes them, until they are computed.
    pending: std::sync::Mutex<Option<Pending>>,
}

struct Pending {
    source: Arc<dyn FeatureSource>,
    bytes: Vec<u8>,
    limits: crate::vision::ImageLimits,
}

/// What turns an image's encoded bytes into its features (the vision side's tower).
trait FeatureSource: Send + Sync {
    fn features(&self, bytes: &[u8], limits: &crate::vision::ImageLimits) -> Result<Vec<f32>>;
}

impl ImageFeatures {
    fn deferred(
        source: Arc<dyn FeatureSource>,
        bytes: Vec<u8>,
        limits: crate::vision::ImageLimits,
    ) -> Self {
        ImageFeatures(Arc::new(FeatureCell {
            ready: std::sync::OnceLock::new(),
            pending: std::sync::Mutex::new(Some(Pending {
                source,
                bytes,
                limits,
            })),
        }))
    }

    /// The features, computed now if nothing has needed them yet (once, however many clones ask at once; after
    /// an error the next call tries again).
    pub fn get(&self) -> Result<Arc<Vec<f32>>> {
        if let Some(v) = self.0.ready.get() {
            return Ok(v.clone());
        }
        let mut pending = self.0.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = self.0.ready.get() {
            return Ok(v.clone()); // computed while this call waited
        }
        let p = pending
            .as_ref()
            .expect("features are either computed or pending");
        let values = Arc::new(p.source.features(&p.bytes, &p.limits)?);
        let _ = self.0.ready.set(values.clone());
        *pending = None;
        Ok(values)
    }

    /// Whether the features have been computed.
    pub fn is_computed(&self) -> bool {
        self.0.ready.get().is_some()
    }

    /// Whether `self` and `other` are one image's features (one computation).
    pub fn same(&self, other: &ImageFeatures) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for ImageFeatures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.ready.get() {
            Some(v) => write!(f, "ImageFeatures({} values)", v.len()),
            None => f.write_str("ImageFeatures(not computed yet)"),
        }
    }
}

/// Where each image id of a request's prompt takes its features from.
#[derive(Debug, Default, Clone)]
pub struct MediaTable {
    rows: HashMap<u32, (usize, usize)>,
    images: Vec<PromptImage>,
    hidden: usize,
}

impl MediaTable {
    /// The table of `images` for a model of hidden size `hidden`; an image whose ids are not image ids, or
    /// whose grid does not hold its rows, is refused (features that are not one row of `hidden` values per id
    /// are, when a forward fetches them).
    pub fn new(images: &[PromptImage], hidden: usize) -> Result<Self> {
        let mut rows = HashMap::new();
        for (n, img) in images.iter().enumerate() {
            if img.ids.iter().any(|&i| !is_media(i)) {
                return Err(Error::Invalid(format!(
                    "image {n}: a row id without the image bit"
                )));
            }
            if let Some([r, c]) = img.grid {
                if r == 0 || c == 0 || r * c != img.ids.len() {
                    return Err(Error::Invalid(format!(
                        "image {n}: a grid of {r} x {c} for {} rows",
                        img.ids.len()
                    )));
                }
            }
            for (r, &id) in img.ids.iter().enumerate() {
                rows.insert(id, (n, r));
            }
        }
        Ok(MediaTable {
            rows,
            images: images.to_vec(),
            hidden,
        })
    }

    /// Image `n`'s features, computed now if no forward has needed them yet, checked against its rows.
    fn features(&self, n: usize) -> Result<Arc<Vec<f32>>> {
        let img = &self.images[n];
        let values = img.features.get()?;
        if values.len() != img.ids.len() * self.hidden {
            return Err(Error::Invalid(format!(
                "image {n}: {} ids and {} feature values for hidden size {}",
                img.ids.len(),
                values.len(),
                self.hidden
            )));
        }
        Ok(values)
    }

    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }

    /// That every image row of `prompt` belongs to one of the request's images, and that the prompt does not
    /// end inside an image (its last token starts the answer).
    pub fn check(&self, prompt: &[u32]) -> Result<()> {
        if let Some(&id) = prompt
            .iter()
            .find(|&&t| is_media(t) && !self.rows.contains_key(&t))
        {
            return Err(Error::Invalid(format!(
                "image row id {id:#x} of no image of the request"
            )));
        }
        if prompt.last().is_some_and(|&t| is_media(t)) {
            return Err(Error::Invalid(
                "a prompt cannot end inside an image (its last token starts the answer)".into(),
            ));
        }
        Ok(())
    }

    /// How far the rotary position of every row after the images of `context` lags behind its index: an image
    /// at multimodal positions takes its grid's longer side in positions, not one per row. 0 without such
    /// images.
    pub fn lag(&self, context: &[u32]) -> usize {
        if self.images.iter().all(|i| i.grid.is_none()) {
            return 0;
        }
        self.runs(context)
            .map(|(img, _, _)| self.images[img].lag())
            .sum()
    }

    /// The images of `context` in order: `(image, its first row's index, rows present)` for each image whose
    /// first row is in `context`.
    fn runs<'a>(&'a self, context: &'a [u32]) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
        let mut at = 0;
        std::iter::from_fn(move || {
            while at < context.len() {
                let i = at;
                at += 1;
                let Some(&(img, 0)) = self.rows.get(&context[i]) else {
                    continue;
                };
                let ids = &self.images[img].ids;
                let n = context[i..]
                    .iter()
                    .zip(ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                at = i + n;
                return Some((img, i, n));
            }
            None
        })
    }

    /// The forward of `body[start..end]` (`body` the prompt, so that rotary positions can account for the
    /// images before `start`): image rows get their features (runs of consecutive rows of one image each a
    /// [`MediaRows`]; an image at consecutive positions has its rows see each other both ways, one at
    /// multimodal positions keeps the causal mask and gets each row's grid position) and the placeholder token
    /// 0; an image id the table does not know is an error.
    pub fn batch(&self, body: &[u32], start: usize, end: usize) -> Result<Batch> {
        let ids = &body[start..end];
        let lag = self.lag(&body[..start]);
        if !ids.iter().any(|&i| is_media(i)) {
            return Ok(Batch::causal(ids, start - lag));
        }
        let h = self.hidden;
        let mut tokens = Vec::with_capacity(ids.len());
        let mut media: Vec<MediaRows> = Vec::new();
        let mut run: Option<(usize, usize, usize)> = None; // (image, its first row, first batch row)
        let mut values: Vec<f32> = Vec::new();
        let mut features: Option<(usize, Arc<Vec<f32>>)> = None; // the last image's, fetched once a run
        let flush = |run: &mut Option<(usize, usize, usize)>,
                     values: &mut Vec<f32>,
                     media: &mut Vec<MediaRows>| {
            if let Some((_, _, first)) = run.take() {
                media.push(MediaRows {
                    first_row: first,
                    rows: values.len() / h,
                    values: Arc::new(std::mem::take(values)),
                });
            }
        };
        for (b, &id) in ids.iter().enumerate() {
            if !is_media(id) {
                flush(&mut run, &mut values, &mut media);
                tokens.push(id);
                continue;
            }
            let &(img, r) = self.rows.get(&id).ok_or_else(|| {
                Error::Invalid(format!("image row id {id:#x} of no image of the request"))
            })?;
            let continues = matches!(run, Some((i, r0, b0)) if i == img && r == r0 + (b - b0));
            if !continues {
                flush(&mut run, &mut values, &mut media);
                run = Some((img, r, b));
            }
            if features.as_ref().is_none_or(|(i, _)| *i != img) {
                features = Some((img, self.features(img)?));
            }
            let f = &features.as_ref().expect("fetched above").1;
            values.extend_from_slice(&f[r * h..][..h]);
            tokens.push(0);
        }
        flush(&mut run, &mut values, &mut media);
        if self.images.iter().all(|i| i.grid.is_none()) {
            return Ok(Batch::with_media(&tokens, start, media));
        }
        let (positions, spatial) = self.positions(body, start, end);
        Ok(Batch::with_positioned_media(
            &tokens, positions, spatial, media,
        ))
    }

    /// Multimodal rotary positions of `body[start..end]`: a text row at its index less the lag of the images
    /// before it; an image's row `r` of a `rows × columns` grid at temporal position `p` (where its first row
    /// would be as text), height position `p + r / columns` and width position `p + r % columns`.
    fn positions(&self, body: &[u32], start: usize, end: usize) -> (Vec<usize>, Vec<[usize; 2]>) {
        let mut out = Vec::with_capacity(end - start);
        let mut lag = 0;
        let mut at = 0; // the next row of `body` to place
        let place = |from: usize, to: usize, lag: usize, out: &mut Vec<[usize; 3]>| {
            for i in from.max(start)..to.min(end) {
                let p = i - lag;
                out.push([p; 3]);
            }
        };
        for (img, first, n) in self.runs(&body[..end]) {
            place(at, first, lag, &mut out);
            let p = first - lag;
            let grid = self.images[img].grid;
            for r in 0..n {
                let i = first + r;
                if (start..end).contains(&i) {
                    out.push(match grid {
                        Some([_, c]) => [p, p + r / c, p + r % c],
                        None => [i - lag; 3],
                    });
                }
            }
            lag += self.images[img].lag();
            at = first + n;
        }
        place(at, end, lag, &mut out);
        debug_assert_eq!(out.len(), end - start);
        out.into_iter().map(|[t, h, w]| (t, [h, w])).unzip()
    }
}

/// The end of a prefill chunk of `body` that would end at `end`, moved past any image run it would cut (an
/// image's rows attend to each other both ways, so they go through one forward).
pub fn chunk_end(body: &[u32], end: usize) -> usize {
    let mut e = end;
    while e < body.len() && e > 0 && is_media(body[e - 1]) && is_media(body[e]) {
        e += 1;
    }
    e
}

/// How many images [`VisionSide`] keeps by content key (a Gemma 3 image's 256 rows at hidden 2,560 are 2.6 MB of
/// features; an image whose features nothing has needed yet keeps its encoded bytes instead).
pub const FEATURE_CACHE_IMAGES: usize = 32;

/// A bundle's vision side (a Gemma 3 or Qwen2.5-VL image-text folder): its processor, the tower loaded on the
/// first image whose features a forward needs (hundreds of megabytes a text-only turn never needs), and the
/// tokens around an image's rows.
pub struct VisionSide<B: Backend> {
    tower: Arc<Tower<B>>,
    /// The processor's settings as content keys take them ([`content_key`]).
    settings: String,
    /// The images seen last, by content key, most recent last: a conversation sends its image again with every
    /// turn (the chat APIs are stateless), and the tower costs far more than the turn's restored prefix; the
    /// same image's requests share one computation. A short recency list: at most [`FEATURE_CACHE_IMAGES`]
    /// entries, so a linear scan.
    recent: std::sync::Mutex<std::collections::VecDeque<(u128, PromptImage)>>,
    /// The tokens that open and close an image's rows (`<start_of_image>` and `<end_of_image>`,
    /// `<|vision_start|>` and `<|vision_end|>`).
    pub begin: u32,
    pub end: u32,
    /// Rows per image, where the tower takes images at one size (Gemma 3's); `None` where an image's rows
    /// follow its size (Qwen2.5-VL's).
    pub tokens: Option<usize>,
    /// What the processor puts between an image's block and the text around it (Gemma 3's blank lines).
    margin: &'static str,
    /// The tower and the processor in words ([`VisionSide::describe`]).
    description: String,
}

/// An image's pixel values as a family's tower takes them.
#[derive(Debug)]
enum Processor {
    Square(crate::vision::SquareProcessor),
    Grid(crate::vision::GridProcessor),
}

/// A family's vision tower and projector.
enum Encoder<B: Backend> {
    Gemma3(crate::vision::Gemma3Vision<B>),
    Qwen25(crate::vision::Qwen25Vision<B>),
}

/// The processor and the tower: what computes an image's features from its bytes.
struct Tower<B: Backend> {
    dir: std::path::PathBuf,
    backend: Arc<B>,
    processor: Processor,
    model: std::sync::OnceLock<Encoder<B>>,
    runs: std::sync::atomic::AtomicUsize,
    /// Nanoseconds spent computing features (decode, preprocessing, tower), over every run.
    nanos: std::sync::atomic::AtomicU64,
}

impl<B: Backend> Tower<B> {
    fn encoder(&self) -> Result<&Encoder<B>> {
        if let Some(m) = self.model.get() {
            return Ok(m);
        }
        let (dir, be) = (&self.dir, self.backend.clone());
        let m = match self.processor {
            Processor::Square(_) => Encoder::Gemma3(crate::vision::Gemma3Vision::load(dir, be)?),
            Processor::Grid(_) => Encoder::Qwen25(crate::vision::Qwen25Vision::load(dir, be)?),
        };
        Ok(self.model.get_or_init(|| m))
    }
}

impl<B: Backend> FeatureSource for Tower<B> {
    fn features(&self, bytes: &[u8], limits: &crate::vision::ImageLimits) -> Result<Vec<f32>> {
        let t = std::time::Instant::now();
        let image = crate::vision::decode(bytes, limits)?;
        let features = match (&self.processor, self.encoder()?) {
            (Processor::Square(p), Encoder::Gemma3(m)) => {
                m.image_features(&p.pixel_values(&image))?
            }
            (Processor::Grid(p), Encoder::Qwen25(m)) => {
                let (pixels, grid) = p.pixel_values(&image)?;
                m.image_features(&pixels, grid)?
            }
            _ => unreachable!("the encoder is loaded for its processor"),
        };
        self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = t.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.nanos
            .fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        Ok(features)
    }
}

impl<B: Backend> VisionSide<B> {
    /// The vision side of the bundle folder `dir`, if its `config.json` has one (a Gemma 3 or Qwen2.5-VL
    /// image-text config); its tower runs on `backend`.
    pub fn open(dir: &std::path::Path, backend: Arc<B>) -> Result<Option<Self>> {
        let read = |name: &str| -> Result<Option<serde_json::Value>> {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(b) => serde_json::from_slice(&b)
                    .map(Some)
                    .map_err(|e| Error::malformed(&path, e.to_string())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(&path, e)),
            }
        };
        let Some(config) = read("config.json")? else {
            return Ok(None);
        };
        if config.get("vision_config").is_none() {
            return Ok(None);
        }
        let family = config.get("model_type").and_then(serde_json::Value::as_str);
        if !matches!(family, Some("gemma3") | Some("qwen2_5_vl")) {
            tracing::warn!(
                "{}: a vision tower of model type {family:?}: images are not taken (Gemma 3 and Qwen2.5-VL are)",
                dir.display()
            );
            return Ok(None);
        }
        // Without its processor's settings the folder still serves text.
        let Some(preprocessor) = read("preprocessor_config.json")? else {
            tracing::warn!(
                "{}: an image-text bundle without preprocessor_config.json: images are not taken",
                dir.display()
            );
            return Ok(None);
        };
        let id = |k: &str| -> Result<u32> {
            config
                .get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| Error::malformed(dir.join("config.json"), format!("no {k}")))
        };
        let (processor, begin, end, tokens, margin, description) = if family == Some("gemma3") {
            let shape = crate::vision::SiglipConfig::from_config(&config)?;
            let p = crate::vision::SquareProcessor::from_config(&preprocessor)?;
            let (b, e) = (id("boi_token_index")?, id("eoi_token_index")?);
            let description = format!(
                "Gemma 3's SigLIP tower ({} layers, hidden {}, {} heads); images resized to {} x {} pixels, {} rows each",
                shape.layers, shape.hidden, shape.heads, p.width, p.height, shape.tokens
            );
            (
                Processor::Square(p),
                b,
                e,
                Some(shape.tokens),
                "\n\n",
                description,
            )
        } else {
            let shape = crate::vision::Qwen25VisionConfig::from_config(&config)?;
            let p = crate::vision::GridProcessor::from_config(&preprocessor)?;
            if (p.patch, p.merge, p.temporal) != (shape.patch_size, shape.merge, shape.temporal) {
                return Err(Error::malformed(
                    dir.join("preprocessor_config.json"),
                    format!(
                        "patches of {} merged {} over {} frames for a tower of {}, {}, {}",
                        p.patch, p.merge, p.temporal, shape.patch_size, shape.merge, shape.temporal
                    ),
                ));
            }
            let (b, e) = (id("vision_start_token_id")?, id("vision_end_token_id")?);
            let description = format!(
                "Qwen2.5-VL's vision transformer ({} layers, hidden {}, {} heads, windows of {} pixels, full \
                 attention in layers {:?}); images resized to multiples of {} pixels within {} to {} pixels, a row \
                 per {} x {} patches of {}",
                shape.layers,
                shape.hidden,
                shape.heads,
                shape.window,
                shape.full_layers,
                p.patch * p.merge,
                p.min_pixels,
                p.max_pixels,
                p.merge,
                p.merge,
                p.patch
            );
            (Processor::Grid(p), b, e, None, "", description)
        };
        Ok(Some(VisionSide {
            settings: format!("{processor:?}"),
            tower: Arc::new(Tower {
                dir: dir.to_path_buf(),
                backend,
                processor,
                model: std::sync::OnceLock::new(),
                runs: Default::default(),
                nanos: Default::default(),
            }),
            recent: Default::default(),
            begin,
            end,
            tokens,
            margin,
            description,
        }))
    }

    /// The tower and how images reach it, in words.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// The image `bytes` (PNG or JPEG) as a prompt's image, its rows keyed by its content and the processor's
    /// settings. The bytes are decoded now (a malformed image fails its request here; its size sets how many
    /// rows it takes where the tower takes images near their own size); the features (decoded again,
    /// preprocessed, through the tower and the projector) are computed when a forward first needs them. An
    /// image among the last [`FEATURE_CACHE_IMAGES`] shares the features of its first sending (the same bytes
    /// and settings: the same values).
    pub fn image(&self, bytes: &[u8], limits: &crate::vision::ImageLimits) -> Result<PromptImage> {
        let key = content_key(bytes, &self.settings);
        if let Some(image) = self.recall(key) {
            return Ok(image);
        }
        let decoded = crate::vision::decode(bytes, limits)?;
        let (tokens, grid) = match &self.tower.processor {
            Processor::Square(_) => (self.tokens.expect("a square tower's rows"), None),
            Processor::Grid(p) => {
                let [rows, cols] = p.grid(decoded.height, decoded.width)?;
                let merged = [rows / p.merge, cols / p.merge];
                (merged[0] * merged[1], Some(merged))
            }
        };
        let features = ImageFeatures::deferred(self.tower.clone(), bytes.to_vec(), *limits);
        let image = PromptImage::new(key, tokens, features, grid);
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        // Another request may have sent the same image meanwhile: one entry per key.
        recent.retain(|(k, _)| *k != key);
        if recent.len() == FEATURE_CACHE_IMAGES {
            recent.pop_front();
        }
        recent.push_back((key, image.clone()));
        Ok(image)
    }

    /// How many images the tower has run on.
    pub fn tower_runs(&self) -> usize {
        self.tower.runs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The time spent computing features (decoding, preprocessing, the tower), over every image.
    pub fn tower_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.tower.nanos.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Forget the images kept by content key (the next sending of one computes its features again).
    pub fn forget_images(&self) {
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// The image keyed `key` if it is among the recent ones (it becomes the most recent).
    fn recall(&self, key: u128) -> Option<PromptImage> {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let at = recent.iter().position(|(k, _)| *k == key)?;
        let entry = recent.remove(at)?;
        let image = entry.1.clone();
        recent.push_back(entry);
        Some(image)
    }

    /// An image's part of a prompt: the opening token, its rows, the closing token.
    pub fn block(&self, image: &PromptImage) -> Vec<u32> {
        let mut ids = Vec::with_capacity(image.ids.len() + 2);
        ids.push(self.begin);
        ids.extend(&image.ids);
        ids.push(self.end);
        ids
    }

    /// What the processor puts between an image's block and the text before and after it.
    pub fn margin(&self) -> &'static str {
        self.margin
    }
}
